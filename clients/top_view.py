"""How ``chatpipe top`` draws a ``Frame``: a summary line, a row per service, a row per consumer group.

The layout of the terminal tools operators already read (k9s, nvtop): one screen, fixed columns,
refreshed in place; "—" where a service has no such figure or none was measured yet, dim figures
where they cover the service's whole life instead of the window.
"""

from __future__ import annotations

import time

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from clients.top import Frame, ServiceRow

DASH = "—"


def _num(value: float | None, digits: int = 1) -> str:
    if value is None:
        return DASH
    return f"{value:,.{digits}f}" if abs(value) < 1e6 else f"{value:.3g}"


def _secs(value: float | None) -> str:
    if value is None:
        return DASH
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s" if value < 100 else f"{value:.0f} s"


def _pair(pair: tuple[float | None, float | None] | None) -> tuple[str, str]:
    return (DASH, DASH) if pair is None else (_secs(pair[0]), _secs(pair[1]))


_STATE_STYLE = {"up": "green", "running": "green", "no /metrics": "yellow"}


def services_table(frame: Frame) -> Table:
    window = f"last {frame.window_s:.0f} s" if frame.window_s else "one scrape: rates from the next"
    table = Table(title=f"services ({window})", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for header in ("SERVICE", "STATE", "PID", "REQS", "REQ/S", "TOK/S", "TTFT p50", "TTFT p95", "TPOT p50",
                   "TPOT p95", "RUN", "WAIT", "BACKLOG", "KV"):  # names left, figures right
        table.add_column(header, justify="left" if header in ("SERVICE", "STATE") else "right", no_wrap=True,
                         min_width=len(header))
    for row in frame.rows:
        table.add_row(*_cells(row))
    return table


def notes(frame: Frame) -> Text:
    """Each service's own figures, a line each under the table (a column would squeeze the figures)."""
    width = max((len(r.name) for r in frame.rows), default=0)
    lines = [Text.assemble(f" {r.name:<{width}}  ", (r.notes, "dim")) for r in frame.rows if r.notes]
    return Text("\n").join(lines)


def _cells(row: ServiceRow) -> list[Text | str]:
    ttft, tpot = _pair(row.ttft), _pair(row.tpot)
    style = "dim" if row.latency_since_start else ""
    return [Text(row.name, style="bold"), Text(row.state, style=_STATE_STYLE.get(row.state, "red")),
            str(row.pid or DASH), _num(row.requests, 0), _num(row.req_s, 2), _num(row.tok_s, 1),
            Text(ttft[0], style=style), Text(ttft[1], style=style), Text(tpot[0], style=style),
            Text(tpot[1], style=style), _num(row.running, 0), _num(row.waiting, 0), _num(row.backlog, 0),
            DASH if row.kv is None else f"{row.kv * 100:.0f}%"]


def lag_table(frame: Frame) -> Table:
    table = Table(title="consumer lag (each member reports its group's: the largest is shown)", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    for header, justify in (("GROUP", "left"), ("TOPIC", "left"), ("RECORDS", "right"), ("OLDEST", "right"),
                            ("REPORTED BY", "left")):
        table.add_column(header, justify=justify, no_wrap=True)
    for lag in frame.lags:
        records = Text("?" if lag.records is None else _num(lag.records, 0),
                       style="yellow" if lag.records else "")
        table.add_row(lag.group, lag.topic, records, _secs(lag.seconds) if lag.seconds else
                      ("?" if lag.seconds is None else "0"), ", ".join(lag.reporters))
    if not frame.lags:
        table.add_row(DASH, "no service reports a group's lag yet (measured every 5 s)", "", "", "")
    return table


def summary(frame: Frame, where: str) -> Text:
    """One line: the pipeline at a glance (the gateway's requests, the workers' tokens, the worst lag)."""
    gateway = [r for r in frame.rows if r.kind == "gateway"]
    workers = [r for r in frame.rows if r.kind == "inference"]
    req_s = sum(r.req_s or 0 for r in gateway)
    tok_s = sum(r.tok_s or 0 for r in workers)
    p95 = max((r.ttft[1] for r in workers if r.ttft and r.ttft[1] is not None), default=None)
    behind = sum(lag.records or 0 for lag in frame.lags)
    oldest = max((lag.seconds or 0 for lag in frame.lags), default=0)
    up = sum(r.state in ("up", "running") for r in frame.rows)
    return Text.assemble(
        ("chatpipe top", "bold"), f" · {where} · {time.strftime('%H:%M:%S', time.localtime(frame.at))} · ",
        (f"{up}/{len(frame.rows)} up", "green" if up == len(frame.rows) else "yellow"),
        f" · gateway {req_s:.2f} req/s · {tok_s:.1f} tok/s · TTFT p95 {_secs(p95)}"
        f" · backlog {behind:.0f}, oldest {_secs(oldest) if oldest else '0'}")


def render(frame: Frame, where: str) -> Group:
    return Group(summary(frame, where), Text(""), services_table(frame), notes(frame), Text(""), lag_table(frame),
                 Text("Ctrl-C quits", style="dim"))
