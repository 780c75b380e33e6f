"""Run the gateway app with uvicorn until SIGTERM / Ctrl-C.

uvicorn handles both signals: it stops accepting connections, gives open requests
``graceful_s`` to finish, then runs the app's shutdown (pending requests get a ``Cancel``, the
producer is flushed, the reply reader stops). A reply reader that stops on its own stops the
server the same way and the process exits 1 (``GatewayService``).
"""

from __future__ import annotations

import signal

from gateway.app import create_app
from gateway.keys import KeyStore
from gateway.settings import GatewaySettings
from transport import spans
from transport.logs import configure_logging, log_format
from transport.settings import KafkaSettings


def serve(kafka: KafkaSettings, settings: GatewaySettings, graceful_s: float = 10.0) -> None:
    import uvicorn

    keys = KeyStore.load(settings.keys_file)  # a bad keys file fails here, before the port is taken
    configure_logging("gateway", settings.log_level)  # CHATPIPE_LOG_FORMAT: text or JSON lines
    app = create_app(kafka, settings, keys)
    # JSON logs: uvicorn's own loggers go through the root handler too (log_config None), one format.
    own_logs = {} if log_format() == "text" else {"log_config": None}
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                            timeout_graceful_shutdown=graceful_s, timeout_keep_alive=settings.keep_alive_s,
                            access_log=False, lifespan="on", **own_logs)
    server = uvicorn.Server(config)
    service = app.state.service
    service.on_failure = lambda exc: setattr(server, "should_exit", True)  # its reply reader stopped
    # uvicorn re-raises the signal that stopped it once it has shut down; with the default handler
    # that would end the process as "killed by SIGTERM". A clean shutdown exits 0 instead.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    spans.configure("gateway")  # CHATPIPE_TRACING_*: where spans go (docs/observability.md)
    try:
        server.run()
    finally:
        spans.shutdown()  # export what is left
    if not server.started:
        raise SystemExit(1)  # the port was taken or startup failed: uvicorn logged why
    if service.failure is not None:
        raise SystemExit(1)  # the reply reader stopped (logged): a supervisor starts a fresh gateway
