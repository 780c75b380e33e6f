"""`chatpipe top` against the real stack (`chatpipe up`: broker, streams worker, inference worker with the
default model, gateway, on free ports), drawn in a real terminal: tmux at 160x50, read back with
`tmux capture-pane`. Requests go through the gateway while it runs, so the screen must show every
service up with its figures moving (requests counted, tokens/s above 0) and the consumer groups' lag.
One stack for the file (about a minute to start on 2 cores)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
import uuid

import httpx
import pytest

from chatpipe.testing.ports import free_port
from tests.infra.test_stack_full import _cli

pytestmark = [pytest.mark.integration, pytest.mark.model]

SERVICES = ("kafka", "streams", "inference", "gateway")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    state = tmp_path_factory.mktemp("top") / "state"
    gateway_port = free_port()
    flags = ["--state-dir", str(state), "--kafka-port", str(free_port()), "--controller-port", str(free_port()),
             "--gateway-port", str(gateway_port), "--worker-metrics-port", str(free_port()),
             "--streams-metrics-port", str(free_port())]
    try:
        up = _cli("up", *flags, timeout=600)
        assert up.returncode == 0, up.stdout + up.stderr
        key = next(iter(json.loads((state / "gateway" / "keys.json").read_text())))
        yield {"state": state, "url": f"http://127.0.0.1:{gateway_port}", "key": key}
    finally:
        down = _cli("down", "--state-dir", str(state), timeout=300)
        assert down.returncode == 0, down.stdout + down.stderr


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
    command = f"env -u COLUMNS -u LINES {sys.executable} -m chatpipe.cli top --state-dir {stack['state']} --window 20"
    screen = ""
    with Traffic(stack["url"], stack["key"]) as traffic:
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
    once = _cli("top", "--once", "--interval", "0.5", "--state-dir", str(stack["state"]), timeout=60)
    assert once.returncode == 0, once.stdout + once.stderr
    for name in SERVICES:
        assert _row(once.stdout, name), f"{name} missing:\n{once.stdout}"
    assert "consumer lag" in once.stdout


def test_top_without_a_stack_says_so_in_one_line(tmp_path):
    """Guards against a traceback or an empty screen when nothing runs in the state folder."""
    result = _cli("top", "--once", "--state-dir", str(tmp_path / "nothing"), timeout=60)
    assert result.returncode == 1
    assert "no stack runs in" in result.stderr and "chatpipe up" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
