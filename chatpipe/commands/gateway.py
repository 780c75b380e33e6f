"""``chatpipe gateway``: the OpenAI-compatible HTTP gateway in front of the pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from chatpipe.commands.common import (BootstrapServers, KafkaSaslMechanism, KafkaSaslPasswordFile, KafkaSaslUsername,
                                      KafkaSecurityProtocol, KafkaSslCaFile, KafkaSslCertFile, KafkaSslKeyFile,
                                      TopicPrefix, build_settings, check_kafka, kafka_settings)
from chatpipe.options import option
from gateway.settings import GatewaySettings  # pydantic only: the flags are made from its fields


def gateway(
    host: Annotated[Optional[str], option(GatewaySettings, "host")] = None,
    port: Annotated[Optional[int], option(GatewaySettings, "port")] = None,
    keys_file: Annotated[Optional[Path], option(GatewaySettings, "keys_file")] = None,
    gateway_id: Annotated[Optional[str], option(GatewaySettings, "gateway_id")] = None,
    max_pending: Annotated[Optional[int], option(GatewaySettings, "max_pending")] = None,
    bootstrap_servers: BootstrapServers = None,
    topic_prefix: TopicPrefix = None,
    log_level: Annotated[Optional[str], option(GatewaySettings, "log_level")] = None,
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
