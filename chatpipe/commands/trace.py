"""``chatpipe trace REQUEST_ID``: one request's trace as a waterfall in the terminal (clients/traces.py).

Where the spans come from: the OTLP/JSON files the stack's services write under
``<state>/traces`` (always), or a Jaeger query API with ``--jaeger URL``. The request id is the one
the gateway returns in its ``x-request-id`` header (and every record of the request carries).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from chatpipe.commands.common import build_settings, err_console, print_error
from chatpipe.options import option
from clients.settings import ClientSettings  # pydantic only: the flags are made from its fields
from transport.spans import TracingSettings


def trace(
    request_id: Annotated[str, typer.Argument(help="The request's id (the gateway's x-request-id header, "
                                                   "request_id on every record)")],
    state_dir: Annotated[Optional[Path], option(ClientSettings, "state_dir", help="State folder whose traces/ to read")] = None,
    traces_dir: Annotated[Optional[Path], option(TracingSettings, "file_dir", "--traces-dir",
                                                 help="Read span files from this folder instead")] = None,
    jaeger: Annotated[Optional[str], typer.Option("--jaeger", help="Read from a Jaeger query API instead, e.g. http://127.0.0.1:16686")] = None,
    wait_s: Annotated[float, typer.Option("--wait-s", min=0, help="Wait up to this long for the trace to appear (services export every 0.5 s)")] = 0.0,
    all_attributes: Annotated[bool, typer.Option("--all", help="Show every attribute, not only the main ones")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per span instead of the table")] = False,
) -> None:
    """Print a request's spans, hop by hop: service, span, start, duration and the attributes that matter."""
    import json
    import time

    from clients.traces import jaeger_trace, read_span_files, trace_of_request

    # --traces-dir, else CHATPIPE_TRACING_FILE_DIR, else <--state-dir or CHATPIPE_STATE_DIR>/traces
    folder = (traces_dir or build_settings(TracingSettings).file_dir
              or build_settings(ClientSettings, state_dir=state_dir).state_dir / "traces")
    if jaeger is None and not folder.is_dir():
        print_error(f"no span files at {folder}: is the stack running there (chatpipe up), or give --state-dir / --traces-dir")
        raise typer.Exit(1)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            rows = jaeger_trace(jaeger, request_id) if jaeger else trace_of_request(read_span_files(folder), request_id)
        except OSError as exc:
            print_error(f"could not read the trace store at {jaeger}: {exc}")
            raise typer.Exit(1) from None
        if rows or time.monotonic() >= deadline:
            break
        time.sleep(0.25)
    if not rows:
        print_error(f"no spans of request {request_id} in {jaeger or folder}")
        raise typer.Exit(1)
    if as_json:
        for r in rows:
            typer.echo(json.dumps({"trace_id": r.trace_id, "span_id": r.span_id, "parent_id": r.parent_id,
                                   "service": r.service, "name": r.name, "start_ns": r.start_ns, "end_ns": r.end_ns,
                                   "attributes": r.attributes, "links": [list(x) for x in r.links],
                                   "error": r.error}))
        return
    _print_waterfall(rows, request_id, all_attributes)


def _print_waterfall(rows, request_id: str, all_attributes: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    from clients.traces import KINDS, SHOWN, tree_order

    own_trace = {r.trace_id for r in rows if r.attributes.get("chatpipe.request_id") == request_id}
    ordered = tree_order([r for r in rows if r.trace_id in own_trace])
    linked = [r for r in rows if r.trace_id not in own_trace]
    depth: dict[str, int] = {}  # in tree order a span's parent comes first; one not among them is a root
    for r in ordered:
        depth[r.span_id] = depth[r.parent_id] + 1 if r.parent_id in depth else 0
    t0 = min(r.start_ns for r in rows)
    total = max(r.end_ns for r in rows) - t0 or 1
    width = 16
    table = Table(title=f"request {request_id}: trace {', '.join(sorted(own_trace))}", title_justify="left",
                  show_lines=False, pad_edge=False)
    for column, justify in (("start ms", "right"), ("ms", "right"), ("service", "left"), ("span", "left"),
                            ("", "left"), ("attributes", "left")):
        table.add_column(column, justify=justify, no_wrap=column != "attributes", overflow="fold")
    for r in ordered + linked:
        length = max(1, round((r.end_ns - r.start_ns) / total * width))
        bar = " " * min(width - 1, round((r.start_ns - t0) / total * width)) + "█" * length
        shown = r.attributes if all_attributes else {label: r.attributes[k] for k, label in SHOWN.items()
                                                     if k in r.attributes}
        attrs = " ".join(f"{k}={_short(v)}" for k, v in shown.items())
        if r.error:
            attrs = f"ERROR {r.error} {attrs}"
        name = ("  " * depth.get(r.span_id, 0) + r.name) if r in ordered else f"↪ {r.name} (batch, links here)"
        table.add_row(f"{(r.start_ns - t0) / 1e6:.1f}", f"{r.duration_ms:.1f}", r.service,
                      f"{name} [{KINDS.get(r.kind, '?')}]", bar[:width], attrs)
    Console(soft_wrap=False, width=max(160, err_console.width)).print(table, markup=False, highlight=False)


def _short(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def register(app: typer.Typer) -> None:
    app.command("trace")(trace)
