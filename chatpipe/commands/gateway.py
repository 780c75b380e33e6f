"""``chatpipe gateway``: the OpenAI-compatible HTTP gateway in front of the pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from chatpipe.commands.common import (KafkaSaslMechanism, KafkaSaslPasswordFile, KafkaSaslUsername,
                                      KafkaSecurityProtocol, KafkaSslCaFile, KafkaSslCertFile, KafkaSslKeyFile,
                                      build_settings, check_kafka, kafka_settings)


def gateway(
    host: Annotated[Optional[str], typer.Option("--host", help="Address to listen on (env CHATPIPE_GATEWAY_HOST; default 127.0.0.1)")] = None,
    port: Annotated[Optional[int], typer.Option("--port", help="HTTP port (env CHATPIPE_GATEWAY_PORT; default 8000)")] = None,
    keys_file: Annotated[Optional[Path], typer.Option("--keys-file", help="JSON file of API keys -> tenants (env CHATPIPE_GATEWAY_KEYS_FILE)")] = None,
    gateway_id: Annotated[Optional[str], typer.Option("--gateway-id", help="Names the reply topic (env CHATPIPE_GATEWAY_GATEWAY_ID; default host-port)")] = None,
    max_pending: Annotated[Optional[int], typer.Option("--max-pending", help="Requests in flight before 429 (env CHATPIPE_GATEWAY_MAX_PENDING; default 32)")] = None,
    bootstrap_servers: Annotated[Optional[str], typer.Option("--bootstrap-servers", "-b", help="Kafka host:port (env CHATPIPE_BOOTSTRAP_SERVERS)")] = None,
    topic_prefix: Annotated[Optional[str], typer.Option("--topic-prefix", help="Prefix of every topic (env CHATPIPE_TOPIC_PREFIX)")] = None,
    log_level: Annotated[Optional[str], typer.Option("--log-level", help="debug, info, warning (env CHATPIPE_GATEWAY_LOG_LEVEL)")] = None,
    kafka_security_protocol: KafkaSecurityProtocol = None,
    kafka_sasl_mechanism: KafkaSaslMechanism = None,
    kafka_sasl_username: KafkaSaslUsername = None,
    kafka_sasl_password_file: KafkaSaslPasswordFile = None,
    kafka_ssl_ca_file: KafkaSslCaFile = None,
    kafka_ssl_cert_file: KafkaSslCertFile = None,
    kafka_ssl_key_file: KafkaSslKeyFile = None,
) -> None:
    """Serve OpenAI's chat-completions API: prompts to chat.prompts, tokens back from this gateway's reply topic."""
    from gateway.server import serve
    from gateway.settings import GatewaySettings

    kafka = kafka_settings(bootstrap_servers, topic_prefix, security_protocol=kafka_security_protocol,
                           sasl_mechanism=kafka_sasl_mechanism, sasl_username=kafka_sasl_username,
                           sasl_password_file=kafka_sasl_password_file, ssl_ca_file=kafka_ssl_ca_file,
                           ssl_cert_file=kafka_ssl_cert_file, ssl_key_file=kafka_ssl_key_file)
    settings = build_settings(GatewaySettings, host=host, port=port, keys_file=keys_file, gateway_id=gateway_id,
                              max_pending=max_pending, log_level=log_level)
    check_kafka(kafka, "gateway")
    serve(kafka, settings)


def register(app: typer.Typer) -> None:
    app.command("gateway")(gateway)
