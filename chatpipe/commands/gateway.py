"""``chatpipe gateway``: the OpenAI-compatible HTTP gateway in front of the pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from chatpipe.commands.common import build_settings


def gateway(
    host: Annotated[Optional[str], typer.Option("--host", help="Address to listen on (env CHATPIPE_GATEWAY_HOST; default 127.0.0.1)")] = None,
    port: Annotated[Optional[int], typer.Option("--port", help="HTTP port (env CHATPIPE_GATEWAY_PORT; default 8000)")] = None,
    keys_file: Annotated[Optional[Path], typer.Option("--keys-file", help="JSON file of API keys -> tenants (env CHATPIPE_GATEWAY_KEYS_FILE)")] = None,
    gateway_id: Annotated[Optional[str], typer.Option("--gateway-id", help="Names the reply topic (env CHATPIPE_GATEWAY_GATEWAY_ID; default host-port)")] = None,
    max_pending: Annotated[Optional[int], typer.Option("--max-pending", help="Requests in flight before 429 (env CHATPIPE_GATEWAY_MAX_PENDING; default 32)")] = None,
    bootstrap_servers: Annotated[Optional[str], typer.Option("--bootstrap-servers", "-b", help="Kafka host:port (env CHATPIPE_BOOTSTRAP_SERVERS)")] = None,
    topic_prefix: Annotated[Optional[str], typer.Option("--topic-prefix", help="Prefix of every topic (env CHATPIPE_TOPIC_PREFIX)")] = None,
    log_level: Annotated[Optional[str], typer.Option("--log-level", help="debug, info, warning (env CHATPIPE_GATEWAY_LOG_LEVEL)")] = None,
) -> None:
    """Serve OpenAI's chat-completions API: prompts to chat.prompts, tokens back from this gateway's reply topic."""
    from inference.gateway.server import serve
    from inference.gateway.settings import GatewaySettings
    from transport.settings import KafkaSettings

    kafka = build_settings(KafkaSettings, bootstrap_servers=bootstrap_servers, topic_prefix=topic_prefix)
    settings = build_settings(GatewaySettings, host=host, port=port, keys_file=keys_file, gateway_id=gateway_id,
                              max_pending=max_pending, log_level=log_level)
    serve(kafka, settings)


def register(app: typer.Typer) -> None:
    app.command("gateway")(gateway)
