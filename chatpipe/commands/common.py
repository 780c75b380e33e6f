"""Helpers shared by the command groups: settings from flags (chatpipe/options.py makes the flags), console
output."""

from __future__ import annotations

import functools
import inspect
import sys
from pathlib import Path
from typing import Annotated, Any, Callable, Optional, TypeVar

import typer
from pydantic import ValidationError
from pydantic_settings import BaseSettings
from rich.console import Console
from rich.table import Table

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


# Set by chatpipe.cli.main: this process is the `chatpipe` program itself, so a command may re-execute it
# (a command invoked in another program's process, typer's CliRunner in the tests, must not replace it).
RUNNING_AS_PROGRAM = False


def run_with_tcmalloc(allocator: str) -> None:
    """Run this `chatpipe` command again with tcmalloc preloaded and torch's 2 MB pages on
    (infra/allocator.py: our engine's CPU steps ~15% faster), before torch loads; nothing when this
    process is not the `chatpipe` program, ``allocator`` is ``"system"``, or both are in place."""
    if RUNNING_AS_PROGRAM:
        from infra.allocator import run_with_tcmalloc as reexec

        reexec(["-m", "chatpipe.cli", *sys.argv[1:]], allocator)


def exit_now(code: int = 0) -> None:
    """Flush what was printed and end the process at once (``os._exit``), skipping the interpreter's teardown.

    For a command that read Parquet with pyarrow: at teardown Arrow's global thread pools are destroyed
    with a thread still joinable, and the process aborts ("terminate called without an active exception",
    SIGABRT) after its right answer. Seen in fresh-clone CI runs of ``chatpipe model lineage`` even with no
    Arrow threads asked for (``use_threads=False``, the filter in Python): 1 run in 8. Only for a command
    whose work is done and whose clients are closed; never in-process (a CliRunner test would end too)."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def table(*columns: str, title: str | None = None, **column_options: Any) -> Table:
    """A rich table with these columns (``column_options`` for each: ``overflow="fold"``, ...)."""
    out = Table(title=title)
    for column in columns:
        out.add_column(column, **column_options)
    return out


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
BootstrapServers = Annotated[Optional[str], option(KafkaSettings, "bootstrap_servers", "--bootstrap-servers", "-b")]
TopicPrefix = Annotated[Optional[str], option(KafkaSettings, "topic_prefix", "--topic-prefix")]
_KAFKA_FLAGS = {"bootstrap_servers": BootstrapServers, "topic_prefix": TopicPrefix}
# The security flags, parameter kafka_<field> -> --kafka-<field> (help: the field's, or the one given here).
_SECURITY_FLAGS = {f"kafka_{field}": Annotated[Optional[kind], option(KafkaSettings, field,
                                                                      f"--kafka-{field.replace('_', '-')}", **help_)]
                   for field, kind, help_ in (
    ("security_protocol", str, {}),
    ("sasl_mechanism", str, {}),
    ("sasl_username", str, {"help": "SASL user (OAUTHBEARER: the OIDC client id); its password only from "
                                    "CHATPIPE_KAFKA_SASL_PASSWORD or --kafka-sasl-password-file, never a flag"}),
    ("sasl_password_file", Path, {}),
    ("ssl_ca_file", Path, {}),
    ("ssl_cert_file", Path, {}),
    ("ssl_key_file", Path, {"help": "PEM private key of --kafka-ssl-cert-file; its password only from "
                                    "CHATPIPE_KAFKA_SSL_KEY_PASSWORD"}),
)}


def with_parameters(command: Callable, params: list[inspect.Parameter]) -> Callable:
    """``command`` as typer reads it: these parameters (typer looks at its signature and annotations)."""
    command.__signature__ = inspect.Signature(params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    return command


def with_kafka_flags(command: Callable) -> Callable:
    """``command`` with the Kafka flags of its ``kafka`` parameter, which receives the ``KafkaSettings``
    they make (a flag not given: the CHATPIPE_* variable, then the default). The flags stand where
    ``kafka`` stands, the security ones last."""

    def flags(names: dict[str, Any]) -> list[inspect.Parameter]:
        return [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None, annotation=annotation)
                for name, annotation in names.items()]

    params = []
    for param in inspect.signature(command, eval_str=True).parameters.values():
        params += flags(_KAFKA_FLAGS) if param.name == "kafka" else [param]
    params += flags(_SECURITY_FLAGS)

    @functools.wraps(command)
    def wrapper(**values: Any) -> None:
        given = {name.removeprefix("kafka_"): values.pop(name) for name in (*_KAFKA_FLAGS, *_SECURITY_FLAGS)}
        command(**values, kafka=build_settings(KafkaSettings, **given))

    return with_parameters(wrapper, params)


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
