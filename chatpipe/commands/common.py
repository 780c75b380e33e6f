"""Helpers shared by the command groups: settings from flags, console output."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional, TypeVar

import typer
from pydantic import ValidationError
from pydantic_settings import BaseSettings
from rich.console import Console

from schemas.errors import ChatpipeError

console = Console()
err_console = Console(stderr=True)


def print_error(message: object) -> None:
    """``error: <message>`` on stderr as one line however long (rich folds at the console's width
    otherwise), the message's text not read as markup (it may hold ``[...]``)."""
    from rich.text import Text

    err_console.print(Text.assemble(("error:", "bold red"), " ", str(message)), soft_wrap=True, highlight=False)

S = TypeVar("S", bound=BaseSettings)


class SettingsError(ChatpipeError):
    """A flag or CHATPIPE_* variable has a value the component cannot use."""


def build_settings(cls: type[S], **flags) -> S:
    """``cls`` from CHATPIPE_* environment variables, overridden by the flags that were given.

    Flags left at ``None`` fall through to the environment, then to the field's default.
    """
    try:
        return cls(**{k: v for k, v in flags.items() if v is not None})
    except ValidationError as exc:
        # A rule on several fields (KafkaSettings' security combinations) has no loc: its line stands alone.
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" if e["loc"] else e["msg"]
                             for e in exc.errors())
        raise SettingsError(f"invalid {cls.__name__}: {problems}") from None


# --- Kafka connection flags, the same on every command that builds KafkaSettings ---------------------
# The SASL password has no flag (a flag shows in `ps` and shell history): CHATPIPE_KAFKA_SASL_PASSWORD
# or --kafka-sasl-password-file (docs/security.md).
KafkaSecurityProtocol = Annotated[Optional[str], typer.Option(
    "--kafka-security-protocol", help="PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL "
                                      "[env CHATPIPE_KAFKA_SECURITY_PROTOCOL; default PLAINTEXT]")]
KafkaSaslMechanism = Annotated[Optional[str], typer.Option(
    "--kafka-sasl-mechanism", help="PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or OAUTHBEARER "
                                   "[env CHATPIPE_KAFKA_SASL_MECHANISM]")]
KafkaSaslUsername = Annotated[Optional[str], typer.Option(
    "--kafka-sasl-username", help="SASL user; its password only from CHATPIPE_KAFKA_SASL_PASSWORD or "
                                  "--kafka-sasl-password-file, never a flag [env CHATPIPE_KAFKA_SASL_USERNAME]")]
KafkaSaslPasswordFile = Annotated[Optional[Path], typer.Option(
    "--kafka-sasl-password-file", help="File holding the SASL password [env CHATPIPE_KAFKA_SASL_PASSWORD_FILE]")]
KafkaSslCaFile = Annotated[Optional[Path], typer.Option(
    "--kafka-ssl-ca-file", help="PEM CA certificate(s) the broker's certificate must chain to "
                                "[env CHATPIPE_KAFKA_SSL_CA_FILE; default the system's]")]
KafkaSslCertFile = Annotated[Optional[Path], typer.Option(
    "--kafka-ssl-cert-file", help="PEM client certificate, for mutual TLS [env CHATPIPE_KAFKA_SSL_CERT_FILE]")]
KafkaSslKeyFile = Annotated[Optional[Path], typer.Option(
    "--kafka-ssl-key-file", help="PEM private key of --kafka-ssl-cert-file; its password only from "
                                 "CHATPIPE_KAFKA_SSL_KEY_PASSWORD [env CHATPIPE_KAFKA_SSL_KEY_FILE]")]


def kafka_settings(bootstrap_servers: str | None = None, topic_prefix: str | None = None, *,
                   security_protocol: str | None = None, sasl_mechanism: str | None = None,
                   sasl_username: str | None = None, sasl_password_file: Path | None = None,
                   ssl_ca_file: Path | None = None, ssl_cert_file: Path | None = None,
                   ssl_key_file: Path | None = None):
    """``KafkaSettings`` from the connection flags (None: the CHATPIPE_* variables, then the defaults)."""
    from transport.settings import KafkaSettings

    return build_settings(KafkaSettings, bootstrap_servers=bootstrap_servers, topic_prefix=topic_prefix,
                          security_protocol=security_protocol, sasl_mechanism=sasl_mechanism,
                          sasl_username=sasl_username, sasl_password_file=sasl_password_file,
                          ssl_ca_file=ssl_ca_file, ssl_cert_file=ssl_cert_file, ssl_key_file=ssl_key_file)


def check_kafka(kafka, command: str) -> None:
    """Before a service starts its clients: the broker takes its credentials and certificate, or the
    command ends here with one line naming the broker, and code 78 (a configuration error, which a
    restart cannot fix). A broker that does not answer at all is left to the service's own retries."""
    from transport.connect_check import EXIT_CONFIG, KafkaConnectError, check_connection

    try:
        check_connection(kafka)
    except KafkaConnectError as exc:
        err_console.print(f"chatpipe {command}: {exc}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_CONFIG) from None
