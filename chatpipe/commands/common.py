"""Helpers shared by the command groups: settings from flags (chatpipe/options.py makes the flags), console
output."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional, TypeVar

import typer
from pydantic import ValidationError
from pydantic_settings import BaseSettings
from rich.console import Console

from chatpipe.options import option
from transport.settings import KafkaSettings  # pydantic only: the flags below are made from its fields

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
KafkaSecurityProtocol = Annotated[Optional[str], option(KafkaSettings, "security_protocol", "--kafka-security-protocol")]
KafkaSaslMechanism = Annotated[Optional[str], option(KafkaSettings, "sasl_mechanism", "--kafka-sasl-mechanism")]
KafkaSaslUsername = Annotated[Optional[str], option(
    KafkaSettings, "sasl_username", "--kafka-sasl-username",
    help="SASL user (OAUTHBEARER: the OIDC client id); its password only from CHATPIPE_KAFKA_SASL_PASSWORD or "
         "--kafka-sasl-password-file, never a flag")]
KafkaSaslPasswordFile = Annotated[Optional[Path], option(KafkaSettings, "sasl_password_file",
                                                         "--kafka-sasl-password-file")]
KafkaSslCaFile = Annotated[Optional[Path], option(KafkaSettings, "ssl_ca_file", "--kafka-ssl-ca-file")]
KafkaSslCertFile = Annotated[Optional[Path], option(KafkaSettings, "ssl_cert_file", "--kafka-ssl-cert-file")]
KafkaSslKeyFile = Annotated[Optional[Path], option(
    KafkaSettings, "ssl_key_file", "--kafka-ssl-key-file",
    help="PEM private key of --kafka-ssl-cert-file; its password only from CHATPIPE_KAFKA_SSL_KEY_PASSWORD")]
BootstrapServers = Annotated[Optional[str], option(KafkaSettings, "bootstrap_servers", "--bootstrap-servers", "-b")]
TopicPrefix = Annotated[Optional[str], option(KafkaSettings, "topic_prefix", "--topic-prefix")]


def kafka_settings(bootstrap_servers: str | None = None, topic_prefix: str | None = None, *,
                   security_protocol: str | None = None, sasl_mechanism: str | None = None,
                   sasl_username: str | None = None, sasl_password_file: Path | None = None,
                   ssl_ca_file: Path | None = None, ssl_cert_file: Path | None = None,
                   ssl_key_file: Path | None = None):
    """``KafkaSettings`` from the connection flags (None: the CHATPIPE_* variables, then the defaults)."""
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
