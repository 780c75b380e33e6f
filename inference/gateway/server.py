"""Run the gateway app with uvicorn until SIGTERM / Ctrl-C.

uvicorn handles both signals: it stops accepting connections, gives open requests
``graceful_s`` to finish, then runs the app's shutdown (pending requests get a ``Cancel``, the
producer is flushed, the reply reader stops).
"""

from __future__ import annotations

import logging
import signal

from inference.gateway.app import create_app
from inference.gateway.keys import KeyStore
from inference.gateway.settings import GatewaySettings
from transport.settings import KafkaSettings


def serve(kafka: KafkaSettings, settings: GatewaySettings, graceful_s: float = 10.0) -> None:
    import uvicorn

    keys = KeyStore.load(settings.keys_file)  # a bad keys file fails here, before the port is taken
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(kafka, settings, keys)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                            timeout_graceful_shutdown=graceful_s, access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal that stopped it once it has shut down; with the default handler
    # that would end the process as "killed by SIGTERM". A clean shutdown exits 0 instead.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    if not server.started:
        raise SystemExit(1)  # the port was taken or startup failed: uvicorn logged why
