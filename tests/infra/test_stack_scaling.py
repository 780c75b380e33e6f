"""`chatpipe up --inference-workers 2` on real processes: the broker and two inference workers with the
default model (no streams, no gateway), on free ports in a temporary state folder, driven through the
CLI. One stack start for the file (about a minute on 2 cores: the two model loads overlap).

Guards: both workers join the one consumer group (so they split its partitions), each is a service of
its own in `status` (pid, /metrics port, restarts), `stop inference-2` stops that one alone, `up` with
a smaller count forgets the surplus, and `down` leaves no process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from chatpipe.testing.ports import free_port, free_port_block
from infra.services import alive
from tests.faults.stack import SERVICE_ENV

pytestmark = [pytest.mark.integration, pytest.mark.model]


def _cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "220", **SERVICE_ENV}
    return subprocess.run([sys.executable, "-m", "chatpipe.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _status(state: Path) -> tuple[int, dict]:
    result = _cli("status", "--state-dir", str(state), "--json")
    return result.returncode, json.loads(result.stdout)


def _pids(state: Path) -> set[int]:
    return {int(p.read_text().split()[0]) for p in [*(state / "run").glob("*.pid"), state / "kafka" / "broker.pid"]
            if p.exists()}


def test_two_inference_workers_share_one_group_and_are_services_of_their_own(tmp_path):
    state = tmp_path / "state"
    metrics = free_port_block(2)
    flags = ["--state-dir", str(state), "--kafka-port", str(free_port()), "--controller-port", str(free_port()),
             "--gateway-port", str(free_port()), "--worker-metrics-port", str(metrics)]
    seen: set[int] = set()
    try:
        up = _cli("up", *flags, "--only", "kafka,inference", "--inference-workers", "2", timeout=600)
        assert up.returncode == 0, up.stdout + up.stderr
        seen |= _pids(state)

        code, data = _status(state)
        assert code == 0, data
        services = {s["name"]: s for s in data["services"]}
        assert list(services) == ["kafka", "streams", "inference", "inference-2", "gateway"]
        workers = [services["inference"], services["inference-2"]]
        assert all(w["healthy"] and w["supervised"] and w["restarts"] == 0 for w in workers), workers
        assert workers[0]["pid"] != workers[1]["pid"]
        assert [w["address"] for w in workers] == [f"http://127.0.0.1:{metrics}/metrics",
                                                   f"http://127.0.0.1:{metrics + 1}/metrics"]
        group = next(g for g in data["groups"] if g["group"] == "chatpipe-inference")
        assert group["members"] == 2, data["groups"]  # one group: the two split its partitions
        assert (state / "logs" / "inference-2.log").exists() and (state / "run" / "inference-2.pid").exists()
        assert json.loads((state / "stack.json").read_text())["settings"]["inference_workers"] == 2

        stop = _cli("stop", "inference-2", "--state-dir", str(state))
        assert stop.returncode == 0 and "inference-2 stopped (SIGTERM)" in stop.stdout, stop.stdout + stop.stderr
        code, data = _status(state)
        services = {s["name"]: s for s in data["services"]}
        assert code == 1 and services["inference-2"]["state"] == "stopped", services["inference-2"]  # held: counts
        assert services["inference"]["healthy"] and services["inference"]["pid"] == workers[0]["pid"]
        assert not alive(workers[1]["pid"])

        # A smaller count: the surplus is forgotten, not left held; the stack is whole again.
        shrink = _cli("up", "--state-dir", str(state), "--only", "kafka,inference", "--inference-workers", "1",
                      timeout=300)
        assert shrink.returncode == 0, shrink.stdout + shrink.stderr
        assert "inference-2 was not running" in shrink.stdout and "already running" in shrink.stdout
        code, data = _status(state)
        assert code == 0 and [s["name"] for s in data["services"]] == ["kafka", "streams", "inference", "gateway"]
        restart_refused = _cli("restart", "inference-2", "--state-dir", str(state))
        assert restart_refused.returncode != 0 and "--inference-workers N" in restart_refused.stdout + restart_refused.stderr
    finally:
        down = _cli("down", "--state-dir", str(state), timeout=300)
    assert down.returncode == 0, down.stdout + down.stderr
    assert [pid for pid in seen if alive(pid)] == []
