"""``chatpipe tail TOPIC``: any catalog topic as JSON lines on stdout (clients/topic_tail.py).

Stops on ``--max``, on ``--timeout-s`` without a message, on Ctrl-C / SIGTERM, and quietly when
the reader of its stdout goes away (``| head``). Status lines go to stderr, records to stdout.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from chatpipe.commands.common import BootstrapServers, TopicPrefix, build_settings, err_console, print_error


def tail(
    topic: Annotated[str, typer.Argument(help="Catalog topic name without the prefix, e.g. chat.turns")],
    from_beginning: Annotated[bool, typer.Option("--from-beginning", help="Start at the oldest retained message (default: only new ones)")] = False,
    max_records: Annotated[Optional[int], typer.Option("--max", min=1, help="Stop after this many lines")] = None,
    timeout_s: Annotated[Optional[float], typer.Option("--timeout-s", min=0, help="Stop after this many seconds without a message")] = None,
    partition: Annotated[Optional[int], typer.Option("--partition", min=0, help="Only this partition")] = None,
    bootstrap_servers: BootstrapServers = None,
    topic_prefix: TopicPrefix = None,
) -> None:
    """Decode a topic to JSON lines: one per message, undecodable ones as {"error": ..., "value_base64": ...}."""
    import json
    import os
    import signal
    import sys

    from clients.topic_tail import TopicTail
    from schemas.errors import ChatpipeError
    from transport.settings import KafkaSettings

    settings = build_settings(KafkaSettings, bootstrap_servers=bootstrap_servers, topic_prefix=topic_prefix)
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(True))
    try:
        tailer = TopicTail(settings, topic, partition=partition, from_beginning=from_beginning)
    except ChatpipeError as exc:
        print_error(exc)  # one line whatever the terminal width (the catalog list is long)
        raise typer.Exit(1) from None
    where = "the beginning" if from_beginning else "the end"
    err_console.print(f"tailing {tailer.topic} partitions {tailer.partitions} from {where}; Ctrl-C stops",
                      markup=False, highlight=False, soft_wrap=True)
    out = sys.stdout
    out.reconfigure(encoding="utf-8")  # JSON lines are UTF-8 whatever the locale
    try:
        for batch in tailer.batches(max_records=max_records, idle_timeout_s=timeout_s, should_stop=lambda: bool(stop)):
            out.write("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in batch))
            out.flush()  # once per poll: a live tail shows each message as it comes
    except BrokenPipeError:
        # The reader left (`| head`): stop quietly. Point stdout at /dev/null so the interpreter's
        # final flush does not raise a second time (Python docs, "Note on SIGPIPE").
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    finally:
        tailer.close()


def register(app: typer.Typer) -> None:
    app.command("tail")(tail)
