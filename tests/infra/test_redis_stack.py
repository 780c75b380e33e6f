"""The stack's Redis (the streams workers' response cache) on real processes: `chatpipe up --only redis` on a
state folder and free ports of its own (its own broker: `up` always starts Kafka), `status`, a SIGKILL, `down`;
and the test fixture for the cache's own tests (chatpipe/testing/redis.py).

Guards: Redis runs with the settings' limits and no persistence, is supervised like every service (a
SIGKILLed one comes back, counted), is shown healthy with its address, and is gone after `down`; a missing
`redis-server` is one line, not a traceback; the fixture's server stops, vanishes and comes back on its port.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from chatpipe.testing.ports import free_port
from chatpipe.testing.redis import RedisServer
from infra.redis_server import ping
from infra.services import alive

pytestmark = pytest.mark.integration


def _cli(*args: str, env_extra: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "250", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "chatpipe.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _status(state: Path) -> tuple[int, dict[str, dict]]:
    result = _cli("status", "--state-dir", str(state), "--json")
    return result.returncode, {s["name"]: s for s in json.loads(result.stdout)["services"]}


class Stack:
    def __init__(self, state: Path, redis_port: int, up: subprocess.CompletedProcess) -> None:
        self.state, self.redis_port, self.up = state, redis_port, up
        self.seen: set[int] = set()

    def redis_pid(self) -> int | None:
        try:
            pid = int((self.state / "run" / "redis.pid").read_text().split()[0])
        except (FileNotFoundError, ValueError, IndexError):
            return None
        self.seen.add(pid)
        return pid


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Kafka and Redis under the supervisor (a small maxmemory, given as a variable, as a user would); `down`
    at the end of the file's tests (and again here: harmless)."""
    state = tmp_path_factory.mktemp("redis-stack") / "state"
    port = free_port()
    up = _cli("up", "--only", "redis", "--state-dir", str(state), "--kafka-port", str(free_port()),
              "--controller-port", str(free_port()), "--redis-port", str(port),
              env_extra={"CHATPIPE_REDIS_MAXMEMORY": "32mb"})
    s = Stack(state, port, up)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield s
    finally:
        _cli("down", "--state-dir", str(state), timeout=300)


def test_up_only_redis_starts_it_supervised_and_status_shows_it_healthy(stack):
    """`--only redis` starts the broker and Redis alone; Redis answers with the limits it was given and keeps
    nothing on disk; `status` (given only the state folder) finds it on its port through stack.json."""
    url = f"redis://127.0.0.1:{stack.redis_port}/0"
    line = next(line for line in stack.up.stdout.splitlines() if line.lstrip("✓ ").startswith("redis"))
    assert "started" in line and url in line, stack.up.stdout
    code, services = _status(stack.state)
    assert code == 0, services
    r = services["redis"]
    assert r["healthy"] and r["supervised"] and r["restarts"] == 0 and r["pid"] == stack.redis_pid(), r
    assert r["address"] == f"{url} (maxmemory 32mb, allkeys-lru, no persistence)"
    assert services["streams"]["state"] == "not started" and services["kafka"]["healthy"]
    saved = json.loads((stack.state / "stack.json").read_text())["settings"]
    assert (saved["redis_port"], saved["redis_maxmemory"], saved["response_cache"]) == (stack.redis_port, "32mb", True)

    assert ping("127.0.0.1", stack.redis_port) == "+PONG"
    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        config = client.config_get("*")
        assert config["maxmemory"] == str(32 * 1024 * 1024) and config["maxmemory-policy"] == "allkeys-lru"
        assert config["save"] == "" and config["appendonly"] == "no"
        assert config["dir"] == str((stack.state / "redis").resolve())
        assert config["bind"] == "127.0.0.1"
    finally:
        client.close()


def test_a_killed_redis_is_started_again_by_the_supervisor(stack):
    """Like any service: SIGKILL, then a new process on the same port within the backoff, counted in `status`."""
    first = stack.redis_pid()
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:
        code, services = _status(stack.state)
        r = services["redis"]
        if r["healthy"] and r["pid"] not in (None, first):
            break
        assert time.monotonic() < deadline, r
        time.sleep(0.5)
    assert r["restarts"] == 1 and r["last_exit"]["reason"] == "killed by SIGKILL", r
    assert ping("127.0.0.1", stack.redis_port) == "+PONG" and stack.redis_pid() == r["pid"]


def test_down_stops_redis_with_sigterm(stack):
    """The last test of the stack: `down` stops Redis (SIGTERM, no SIGKILL needed) and frees its port."""
    stack.redis_pid()
    down = _cli("down", "--state-dir", str(stack.state), timeout=300)
    assert down.returncode == 0, down.stdout + down.stderr
    line = next(line for line in down.stdout.splitlines() if line.startswith("redis"))
    assert "stopped (SIGTERM)" in line, down.stdout
    assert down.stdout.index("redis") < down.stdout.index("kafka")  # stopped before the broker
    assert [pid for pid in stack.seen if alive(pid)] == []
    assert ping("127.0.0.1", stack.redis_port) == ""


def test_a_missing_redis_server_is_one_line_from_the_cli(tmp_path):
    result = _cli("up", "--only", "redis", "--state-dir", str(tmp_path / "state"), "--kafka-port", str(free_port()),
                  "--controller-port", str(free_port()), env_extra={"CHATPIPE_REDIS_SERVER": "no-such-redis-server"})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "'no-such-redis-server' not found" in result.stderr and "Traceback" not in result.stderr
    assert "--no-response-cache" in " ".join(result.stderr.split())
    assert not (tmp_path / "state" / "kafka").exists()  # nothing was started


def test_the_fixture_server_stops_vanishes_and_comes_back_on_its_port(tmp_path):
    """What the response cache's tests do with it: Redis killed mid-run (refuses), then back on the same URL,
    empty (a cache: nothing persisted), and used again."""
    server = RedisServer(tmp_path, maxmemory="16mb")
    assert server.url == f"redis://127.0.0.1:{server.port}/0" and server.ping() == ""
    with server:
        assert server.ping() == "+PONG" and server.running()
        client = redis.Redis.from_url(server.url, socket_timeout=2)
        try:
            assert client.config_get("maxmemory")["maxmemory"] == str(16 * 1024 * 1024)
            client.set("k", "v")
            first = server.pid
            server.kill()
            assert not server.running() and server.ping() == ""
            with pytest.raises(redis.ConnectionError):
                client.get("k")
            server.start()
            assert server.ping() == "+PONG" and server.pid != first
            assert client.get("k") is None  # back empty: nothing was persisted
            client.set("k", "w")
            assert client.get("k") == b"w"
        finally:
            client.close()
        server.stop()
        assert not server.running() and server.ping() == ""
        server.start()  # and again after a clean stop
        assert server.answers()
    assert not server.running()
    assert "Ready to accept connections" in server.log_tail(200)
