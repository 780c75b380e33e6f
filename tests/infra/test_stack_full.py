"""`chatpipe up` (the whole stack, two inference workers), `status`, `top`, `stop`, a smaller `up` and
`down` on real processes: one broker, the streams worker, two inference workers with the default model
and the gateway, on free ports in a temporary state folder, driven through the CLI.

One stack start serves the file (about a minute on 2 cores: the two model loads overlap); the tests
run in file order on it and the last one stops it. Guards: every service healthy, a second `up`
leaves them alone, the gateway answers with the generated key file in place; both workers join the
one consumer group and each is a service of its own (pid, /metrics port, restarts), `stop inference-2`
stops that one alone, `up` with a smaller count forgets the surplus; `chatpipe top` in a real terminal
shows every service live; `down` stops every process with SIGTERM alone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from chatpipe.testing.ports import free_port, free_port_block
from infra.services import alive

pytestmark = [pytest.mark.integration, pytest.mark.model]

SERVICES = ("kafka", "redis", "streams", "inference", "gateway")
SCALED = ("kafka", "redis", "streams", "inference", "inference-2", "gateway")


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "220"}
    return subprocess.run([sys.executable, "-m", "chatpipe.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _pids(state: Path) -> dict[str, int]:
    """Service (and supervisor) name -> pid, from the state folder's pid files."""
    files = {"kafka": state / "kafka" / "broker.pid", **{p.stem: p for p in (state / "run").glob("*.pid")}}
    return {name: int(path.read_text().split()[0]) for name, path in files.items() if path.exists()}


def _status(state: Path) -> tuple[int, dict]:
    result = _cli("status", "--state-dir", str(state), "--json")
    return result.returncode, json.loads(result.stdout)


@dataclass
class Stack:
    state: Path
    url: str
    metrics_port: int
    key: str = ""
    up: subprocess.CompletedProcess | None = None
    seen: set[int] = field(default_factory=set)  # every pid the stack had


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    state = tmp_path_factory.mktemp("stack") / "state"
    gateway_port, metrics = free_port(), free_port_block(2)
    stack = Stack(state, f"http://127.0.0.1:{gateway_port}", metrics)
    flags = ["--state-dir", str(state), "--kafka-port", str(free_port()), "--controller-port", str(free_port()),
             "--gateway-port", str(gateway_port), "--worker-metrics-port", str(metrics),
             "--streams-metrics-port", str(free_port()), "--redis-port", str(free_port()), "--inference-workers", "2"]
    try:
        stack.up = _cli("up", *flags, timeout=600)
        assert stack.up.returncode == 0, stack.up.stdout + stack.up.stderr
        stack.seen |= set(_pids(state).values())
        stack.key = next(iter(json.loads((state / "gateway" / "keys.json").read_text())))
        yield stack
    finally:
        _cli("down", "--state-dir", str(state), timeout=300)  # already down after the last test: harmless


def test_up_starts_every_service_healthy_and_a_second_up_changes_nothing(stack):
    """`status` shows each service healthy with its pid, the gateway answers /healthz with the generated
    key file in place (mode 600), and a second `up` leaves every service alone."""
    pids = _pids(stack.state)
    status = _cli("status", "--state-dir", str(stack.state))
    assert status.returncode == 0, status.stdout + status.stderr
    for name in SCALED:
        row = next(line for line in status.stdout.splitlines() if re.search(rf"│ {name}\s+│", line))
        assert "healthy" in row and str(pids[name]) in row, row
    assert "chatpipe-inference" in status.stdout and "chatpipe-streams" in status.stdout  # group lag table

    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(f"{stack.url}/healthz", timeout=10) as reply:
        assert reply.status == 200 and json.loads(reply.read())["status"] == "ok"
    keys_file = stack.state / "gateway" / "keys.json"
    assert stack.key.startswith("sk-local-") and stack.key in stack.up.stdout
    assert stat.S_IMODE(keys_file.stat().st_mode) == 0o600

    again = _cli("up", "--state-dir", str(stack.state), timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.count("already running") == len(SCALED) and _pids(stack.state) == pids


def test_two_inference_workers_share_one_group_and_are_services_of_their_own(stack):
    """Both workers join the one consumer group (so they split its partitions), each is a service of its
    own in `status`; `stop inference-2` stops that one alone; `up` with a smaller count forgets it."""
    code, data = _status(stack.state)
    assert code == 0, data
    services = {s["name"]: s for s in data["services"]}
    assert list(services) == list(SCALED)
    workers = [services["inference"], services["inference-2"]]
    assert all(w["healthy"] and w["supervised"] and w["restarts"] == 0 for w in workers), workers
    assert workers[0]["pid"] != workers[1]["pid"]
    assert [w["address"] for w in workers] == [f"http://127.0.0.1:{stack.metrics_port}/metrics",
                                               f"http://127.0.0.1:{stack.metrics_port + 1}/metrics"]
    group = next(g for g in data["groups"] if g["group"] == "chatpipe-inference")
    assert group["members"] == 2, data["groups"]  # one group: the two split its partitions
    assert (stack.state / "logs" / "inference-2.log").exists() and (stack.state / "run" / "inference-2.pid").exists()
    assert json.loads((stack.state / "stack.json").read_text())["settings"]["inference_workers"] == 2

    stop = _cli("stop", "inference-2", "--state-dir", str(stack.state))
    assert stop.returncode == 0 and "inference-2 stopped (SIGTERM)" in stop.stdout, stop.stdout + stop.stderr
    code, data = _status(stack.state)
    services = {s["name"]: s for s in data["services"]}
    assert code == 1 and services["inference-2"]["state"] == "stopped", services["inference-2"]  # held: counts
    assert services["inference"]["healthy"] and services["inference"]["pid"] == workers[0]["pid"]
    assert not alive(workers[1]["pid"])

    # A smaller count: the surplus is forgotten, not left held; the stack is whole again.
    shrink = _cli("up", "--state-dir", str(stack.state), "--inference-workers", "1", timeout=300)
    assert shrink.returncode == 0, shrink.stdout + shrink.stderr
    assert "inference-2 was not running" in shrink.stdout and "already running" in shrink.stdout
    code, data = _status(stack.state)
    assert code == 0 and [s["name"] for s in data["services"]] == list(SERVICES)
    refused = _cli("restart", "inference-2", "--state-dir", str(stack.state))
    assert refused.returncode != 0 and "--inference-workers N" in refused.stdout + refused.stderr


class Traffic:
    """Chat completions through the gateway, one after the other, until stopped."""

    def __init__(self, url: str, key: str) -> None:
        self.url, self.key = url, key
        self.done = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.key}"}, timeout=120,
                          trust_env=False) as client:
            while not self._stop.is_set():
                reply = client.post("/v1/chat/completions", json={
                    "model": "smollm2-135m-instruct", "max_tokens": 24, "user": f"top-{uuid.uuid4().hex[:6]}",
                    "messages": [{"role": "user", "content": f"Count from one to ten ({self.done})."}]})
                if reply.status_code == 200:
                    self.done += 1
                else:
                    self.errors.append(f"{reply.status_code} {reply.text[:200]}")

    def __enter__(self) -> "Traffic":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(150)


def _row(screen: str, service: str) -> list[str]:
    """The cells of ``service``'s row in the services table (split on blanks: names and states are one word)."""
    for line in screen.splitlines():
        cells = line.split()
        if cells and cells[0] == service:
            return cells
    return []


def _number(cell: str) -> float:
    return 0.0 if cell == "—" else float(cell.replace(",", ""))


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_top_in_a_terminal_shows_every_service_live_with_moving_figures_and_the_groups_lag(stack):
    """Guards against a `top` that cannot find the stack's services (ports from stack.json), draws
    nothing in a real terminal, shows rates that never move while requests are served, or leaves
    out the consumer groups."""
    # A tmux server of its own (-L): another one already running could impose its own window size.
    tmux = ["tmux", "-L", f"chatpipe-top-{uuid.uuid4().hex[:8]}"]
    # Without COLUMNS / LINES (seen set to 80 / 24 in a pane started under pytest): the pane's own size counts.
    command = f"env -u COLUMNS -u LINES {sys.executable} -m chatpipe.cli top --state-dir {stack.state} --window 20"
    screen = ""
    with Traffic(stack.url, stack.key) as traffic:
        subprocess.run([*tmux, "new-session", "-d", "-s", "top", "-x", "160", "-y", "50", command], check=True)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                time.sleep(2)
                screen = subprocess.run([*tmux, "capture-pane", "-p", "-t", "top"], capture_output=True,
                                        text=True, check=True).stdout
                rows = {name: _row(screen, name) for name in SERVICES}
                if (all(len(r) > 3 and r[1] in ("up", "running") for r in rows.values())
                        and _number(rows["gateway"][3]) >= 1 and _number(rows["inference"][5]) > 0
                        and "chatpipe-inference" in screen and "chatpipe-streams" in screen):
                    break
            size = subprocess.run([*tmux, "display", "-p", "-t", "top", "#{window_width}x#{window_height}"],
                                  capture_output=True, text=True).stdout.strip()
        finally:
            subprocess.run([*tmux, "kill-server"], check=False)
    print(f"tmux window {size}:\n{screen}")
    assert size == "160x50", size
    assert not traffic.errors, traffic.errors
    assert traffic.done >= 1, "no request answered through the gateway"
    rows = {name: _row(screen, name) for name in SERVICES}
    for name, cells in rows.items():
        assert len(cells) > 3 and cells[1] in ("up", "running"), f"{name} not shown as up:\n{screen}"
    assert _number(rows["gateway"][3]) >= 1, f"the gateway's requests are not counted:\n{screen}"
    assert _number(rows["inference"][5]) > 0, f"no tokens/s while requests are served:\n{screen}"
    assert _number(rows["streams"][3]) >= 1, f"the prompts streams served are not counted:\n{screen}"
    for text in ("TTFT p95", "TPOT p50", "BACKLOG", "consumer lag", "chatpipe-inference", "chatpipe-streams",
                 "chat.inference.requests", "chat.prompts"):
        assert text in screen, f"{text!r} not on the screen:\n{screen}"


def test_top_once_prints_one_frame_and_exits(stack):
    """Guards against `--once` (for scripts) hanging in the live loop or printing an empty frame."""
    once = _cli("top", "--once", "--interval", "0.5", "--state-dir", str(stack.state), timeout=60)
    assert once.returncode == 0, once.stdout + once.stderr
    for name in SERVICES:
        assert _row(once.stdout, name), f"{name} missing:\n{once.stdout}"
    assert "consumer lag" in once.stdout


def test_down_stops_every_process_with_sigterm_alone(stack):
    """The last test of the file: `down` stops every service with SIGTERM (no SIGKILL needed), no
    process the stack ever had is left, and `status` says stopped."""
    down = _cli("down", "--state-dir", str(stack.state), timeout=300)
    assert down.returncode == 0, down.stdout + down.stderr
    for name in SERVICES:
        line = next(line for line in down.stdout.splitlines() if line.startswith(name))
        assert "stopped (SIGTERM)" in line, down.stdout
    assert [pid for pid in stack.seen if alive(pid)] == []
    after = _cli("status", "--state-dir", str(stack.state))
    assert after.returncode == 1 and "stopped" in after.stdout
