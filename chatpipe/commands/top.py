"""``chatpipe top``: the live pipeline of the local stack, refreshed every second (``clients/top.py``).

Finds the services of the state folder the way ``chatpipe status`` does (``LocalStack.open``: the
ports saved in ``stack.json``), scrapes each one's ``/metrics`` and draws one screen with rich's
``Live`` (``clients/top_view.py``); ``--once`` prints a single frame (two scrapes ``--interval``
apart, so it has rates) and exits, for scripts. Services are found again every few seconds, so a
worker that restarts or is added shows up.
"""

from __future__ import annotations

import time
from typing import Annotated

import typer

from chatpipe.commands.common import build_settings, console, print_error
from chatpipe.commands.stack import StateDir

REDISCOVER_S = 5.0


def stack_targets(stack) -> list:
    """A ``Target`` per running service of ``stack``, in start order, with its /metrics where it has one."""
    from clients.top import Target
    from infra.instances import kind_of, metrics_port, parse_instance, streams_metrics_port
    from infra.services import ServiceProcess

    s = stack.settings
    running = stack.running_services()
    names = [n for n in stack.names if n in running] + sorted(running - set(stack.names))
    targets = []
    for name in names:
        kind = kind_of(name)
        index = (parse_instance(name) or (name, 1))[1]
        url = {"gateway": f"{s.gateway_url}/metrics",
               "inference": f"http://{s.host}:{metrics_port(s, index)}/metrics",
               "streams": f"http://{s.host}:{streams_metrics_port(s, index)}/metrics"}.get(kind)
        pid = stack.kafka.pid() if name == "kafka" else ServiceProcess(name, s).pid()
        targets.append(Target(name, kind, url, pid))
    return targets


def top(
    state_dir: StateDir = None,
    once: Annotated[bool, typer.Option("--once", help="Print one frame (two scrapes --interval apart) and exit")] = False,
    interval_s: Annotated[float, typer.Option("--interval", min=0.1, help="Seconds between refreshes")] = 1.0,
    window_s: Annotated[float, typer.Option("--window", min=1.0, help="Seconds the rates and percentiles cover")] = 10.0,
) -> None:
    """Show the running stack live: requests/s, tokens/s, TTFT/TPOT p50/p95, backlog, KV use per service; lag per group."""
    from clients.top import Sampler
    from clients.top_view import render
    from infra.settings import StackSettings
    from infra.stack import LocalStack

    stack = LocalStack.open(build_settings(StackSettings, state_dir=state_dir))
    where = str(stack.settings.state_dir.resolve())
    targets = stack_targets(stack)
    if not targets:
        print_error(f"no stack runs in {where}: `chatpipe up` starts one (or give the --state-dir of a running one)")
        raise typer.Exit(1)
    sampler = Sampler(targets, window_s=window_s)
    if once:
        sampler.sample()
        time.sleep(interval_s)
        sampler.sample()
        console.print(render(sampler.frame(), where))
        return
    from rich.live import Live

    found_at = time.monotonic()
    try:
        with Live(console=console, screen=True, auto_refresh=False) as live:
            while True:
                began = time.monotonic()
                if began - found_at > REDISCOVER_S:
                    sampler.set_targets(stack_targets(stack))
                    found_at = began
                sampler.sample()
                live.update(render(sampler.frame(), where), refresh=True)
                time.sleep(max(0.0, interval_s - (time.monotonic() - began)))
    except KeyboardInterrupt:
        pass


def register(app: typer.Typer) -> None:
    app.command()(top)
