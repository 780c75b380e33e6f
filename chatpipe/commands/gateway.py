"""``chatpipe gateway``: the OpenAI-compatible HTTP gateway in front of the pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from chatpipe.commands.common import build_settings, check_kafka, with_kafka_flags
from chatpipe.options import option
from gateway.settings import GatewaySettings  # pydantic only: the flags are made from its fields
from transport.settings import KafkaSettings


@with_kafka_flags
def gateway(
    host: Annotated[Optional[str], option(GatewaySettings, "host")] = None,
    port: Annotated[Optional[int], option(GatewaySettings, "port")] = None,
    keys_file: Annotated[Optional[Path], option(GatewaySettings, "keys_file")] = None,
    gateway_id: Annotated[Optional[str], option(GatewaySettings, "gateway_id")] = None,
    max_pending: Annotated[Optional[int], option(GatewaySettings, "max_pending")] = None,
    kafka: Optional[KafkaSettings] = None,  # from --bootstrap-servers, --topic-prefix, --kafka-* (with_kafka_flags)
    log_level: Annotated[Optional[str], option(GatewaySettings, "log_level")] = None,
) -> None:
    """Serve OpenAI's chat-completions API: prompts to chat.prompts, tokens back from this gateway's reply topic."""
    from gateway.server import serve

    settings = build_settings(GatewaySettings, host=host, port=port, keys_file=keys_file, gateway_id=gateway_id,
                              max_pending=max_pending, log_level=log_level)
    check_kafka(kafka, "gateway")
    serve(kafka, settings)


def register(app: typer.Typer) -> None:
    app.command("gateway")(gateway)
