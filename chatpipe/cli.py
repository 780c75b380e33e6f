"""Entry point of the ``chatpipe`` console script.

Each command group lives in ``chatpipe/commands/<group>.py`` and imports its heavy
dependencies (torch, pyspark, ...) inside the command, so ``chatpipe --help`` stays instant.
"""

from __future__ import annotations

import typer

from chatpipe.commands import chat, cluster, demo, engine, gateway, inference, jobs, spark, stack, streams, tail, topics
from chatpipe.commands import forget
from chatpipe.commands import top
from chatpipe.commands import trace
from chatpipe.commands import capacity
from chatpipe.commands import k8s
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

for group in (stack, topics, engine, jobs, streams, inference, gateway, tail, chat, demo, cluster, spark):
    group.register(app)
forget.register(app)  # chatpipe forget USER --tenant T [--conversation C] [--verify]
top.register(app)  # chatpipe top [--once]: the live pipeline from every service's /metrics
trace.register(app)  # chatpipe trace REQUEST_ID: the request's spans as a waterfall
capacity.register(app)  # chatpipe capacity [--users N] / capacity simulate: sizing and a day of KEDA autoscaling
k8s.register(app)  # chatpipe k8s render [--values FILE] [--out DIR]: Kubernetes manifests
settings_command.register(app)  # chatpipe settings docs [--write|--check] / settings check: every CHATPIPE_* variable


def main() -> None:
    try:
        app()
    except ChatpipeError as exc:
        # A named error carries a message meant for the user: no traceback, one line.
        print_error(exc)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
