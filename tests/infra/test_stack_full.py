"""`chatpipe up` (the whole stack), `status` and `down` on real processes: one broker, the streams
worker, one inference worker with the default model and the gateway, on free ports in a temporary
state folder. One stack start for the whole file (about a minute on 2 cores)."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from chatpipe.testing.ports import free_port
from infra.services import alive

pytestmark = [pytest.mark.integration, pytest.mark.model]

SERVICES = ("kafka", "streams", "inference", "gateway")


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "220"}
    return subprocess.run([sys.executable, "-m", "chatpipe.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _pids(state: Path) -> dict[str, int]:
    files = {"kafka": state / "kafka" / "broker.pid", **{n: state / "run" / f"{n}.pid" for n in SERVICES[1:]}}
    return {name: int(path.read_text().split()[0]) for name, path in files.items()}


def test_up_starts_every_service_healthy_and_down_stops_every_process(tmp_path):
    """`up` must leave all four services running and healthy (a second `up` leaves them alone),
    `status` must show each with its pid, the gateway must answer /healthz with the generated key
    file in place, and `down` must stop every process with SIGTERM alone."""
    state = tmp_path / "state"
    gateway_port = free_port()
    flags = ["--state-dir", str(state), "--kafka-port", str(free_port()), "--controller-port", str(free_port()),
             "--gateway-port", str(gateway_port), "--worker-metrics-port", str(free_port()),
             "--streams-metrics-port", str(free_port())]
    pids: dict[str, int] = {}
    try:
        up = _cli("up", *flags, timeout=600)
        assert up.returncode == 0, up.stdout + up.stderr
        pids = _pids(state)

        status = _cli("status", "--state-dir", str(state))
        assert status.returncode == 0, status.stdout + status.stderr
        for name in SERVICES:
            row = next(line for line in status.stdout.splitlines() if re.search(rf"│ {name}\s+│", line))
            assert "healthy" in row and str(pids[name]) in row, row
        assert "chatpipe-inference" in status.stdout and "chatpipe-streams" in status.stdout  # group lag table

        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                f"http://127.0.0.1:{gateway_port}/healthz", timeout=10) as reply:
            assert reply.status == 200 and json.loads(reply.read())["status"] == "ok"
        keys_file = state / "gateway" / "keys.json"
        key = next(iter(json.loads(keys_file.read_text())))
        assert key.startswith("sk-local-") and key in up.stdout
        assert stat.S_IMODE(keys_file.stat().st_mode) == 0o600

        again = _cli("up", "--state-dir", str(state), timeout=300)
        assert again.returncode == 0, again.stdout + again.stderr
        assert again.stdout.count("already running") == len(SERVICES) and _pids(state) == pids
    finally:
        down = _cli("down", "--state-dir", str(state), timeout=300)
    assert down.returncode == 0, down.stdout + down.stderr
    for name in SERVICES:
        line = next(line for line in down.stdout.splitlines() if line.startswith(name))
        assert "stopped (SIGTERM)" in line, down.stdout
    assert [name for name, pid in pids.items() if alive(pid)] == []
    after = _cli("status", "--state-dir", str(state))
    assert after.returncode == 1 and "stopped" in after.stdout
