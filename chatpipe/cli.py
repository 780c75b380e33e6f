"""Entry point of the ``chatpipe`` console script.

Each command group lives in ``chatpipe/commands/<group>.py`` and imports its heavy
dependencies (torch, pyspark, ...) inside the command, so ``chatpipe --help`` stays instant.
"""

from __future__ import annotations

import typer

from chatpipe.commands import (batches, cache, capacity, chat, cluster, demo, engine, forget, gateway, inference, jobs, k8s, models,
                               spark, stack, streams, tail, top, topics, trace, train)
from chatpipe.commands import common
from chatpipe.commands import settings as settings_command
from chatpipe.commands.common import print_error

from schemas.errors import ChatpipeError

app = typer.Typer(
    name="chatpipe",
    help="Streaming, event-driven data and inference pipeline for chat LLMs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    # Help texts end in "[env CHATPIPE_...; default ...]": rich markup would take that for a style tag
    # and drop it, so help is rendered as plain text (every command group inherits this).
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# Each module registers its commands (or command group); this order is the order of `chatpipe --help`.
for group in (stack, topics, engine, models, jobs, train, streams, inference, gateway, tail, chat, demo, cluster, spark, forget, cache, batches,
              top, trace, capacity, k8s, settings_command):
    group.register(app)


def main() -> None:
    common.RUNNING_AS_PROGRAM = True  # commands may re-execute this process (common.run_with_tcmalloc)
    try:
        app()
    except ChatpipeError as exc:
        # A named error carries a message meant for the user: no traceback, one line.
        print_error(exc)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
