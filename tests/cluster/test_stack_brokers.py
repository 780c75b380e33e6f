"""`chatpipe up --brokers 3`: the stack's Kafka as a three-node KRaft cluster, through the CLI.

Guards: the flag starts three real nodes and replicates the catalog on them; `status` finds the
cluster from the state folder alone (no flag repeated) and shows every node, the controller leader
and each partition's in-sync replicas; `down` stops every node.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from chatpipe.testing.ports import free_port

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def chatpipe(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "chatpipe.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_up_with_three_brokers_runs_a_replicated_cluster(tmp_path):
    state = tmp_path / "state"
    env = {**os.environ, "CHATPIPE_STATE_DIR": str(state), "COLUMNS": "250",
           "CHATPIPE_CLIENT_PORTS": json.dumps([free_port() for _ in range(3)]),
           "CHATPIPE_CONTROLLER_PORTS": json.dumps([free_port() for _ in range(3)])}
    try:
        up = chatpipe("up", "--only", "kafka", "--brokers", "3", env=env)
        assert up.returncode == 0, up.stdout + up.stderr
        assert "3 nodes" in up.stdout
        assert json.loads((state / "stack.json").read_text())["settings"]["brokers"] == 3

        status = chatpipe("status", env=env, timeout=120)
        assert status.returncode == 0, status.stdout + status.stderr
        assert "controller leader: node" in status.stdout
        lines = status.stdout.splitlines()
        assert len([line for line in lines if " live " in line]) == 3, status.stdout
        # partitions table rows: │ topic │ partition │ leader │ replicas │ in-sync replicas │
        rows = [[c.strip() for c in line.split("│")[1:-1]] for line in lines if line.count("│") == 6]
        prompts = [r for r in rows if r[0] == "chat.prompts"]
        assert len(prompts) == 6, status.stdout
        assert all(len(r[3].split(",")) == 3 and set(r[4].split(",")) == set(r[3].split(",")) for r in prompts), \
            "chat.prompts partitions are not replicated on 3 nodes, all in sync"
    finally:
        down = chatpipe("down", env=env, timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    pids = [int(p.read_text().split()[0]) for p in state.glob("cluster/node-*/node.pid")]
    assert not pids, f"node pid files left: {pids}"
    again = chatpipe("status", env=env, timeout=120)
    assert again.returncode == 1
