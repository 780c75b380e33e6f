"""Redis as a service of the local stack (the streams workers' response cache, infra/redis_server.py): its
command line, where it sits among the services, the settings kept for it, the flags, and the one-line
errors; plain logic, no process (tests/infra/test_redis_stack.py runs it)."""

from __future__ import annotations

import socket

import pytest

from infra import redis_server, stack_state
from infra.local_kafka import PortInUseError, StackError
from infra.settings import PERSISTED_FIELDS, StackSettings
from infra.stack import ALL, LocalStack


def _arg(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_redis_runs_after_kafka_and_before_the_streams_workers_as_a_cache_only(tmp_path):
    """Started after Kafka and before the workers that use it (so stopped after them), with the limits of
    the settings, and nothing written to disk: a cache that restarts empty, never a store to recover."""
    settings = StackSettings(state_dir=tmp_path, redis_port=16380, redis_maxmemory="64mb",
                             redis_maxmemory_policy="allkeys-lfu", streams_workers=2,
                             qdrant_url="http://127.0.0.1:6333", observability=True)
    stack = LocalStack(settings)
    assert stack.names == ("kafka", "jaeger", "prometheus", "redis", "streams", "streams-2", "inference", "gateway")
    assert "redis" in ALL

    spec = stack._service_spec("redis")
    argv = list(spec.argv)
    assert argv[0] == redis_server.executable(settings)
    assert argv[1:] == ["--bind", "127.0.0.1", "--port", "16380", "--maxmemory", "64mb",
                        "--maxmemory-policy", "allkeys-lfu", "--save", "", "--appendonly", "no",
                        "--dir", str(tmp_path.resolve() / "redis"), "--protected-mode", "no"]
    assert spec.cwd == str(tmp_path.resolve() / "redis")
    assert spec.log_file == str(tmp_path.resolve() / "logs" / "redis.log")
    assert spec.pid_file == str(tmp_path.resolve() / "run" / "redis.pid")
    assert stack.address("redis") == "redis://127.0.0.1:16380/0 (maxmemory 64mb, allkeys-lfu, no persistence)"

    # every streams worker the one Redis (a hit for one is a hit for all)
    for name in ("streams", "streams-2"):
        assert _arg(stack.command(name), "--cache-url") == "redis://127.0.0.1:16380/0"


def test_without_the_response_cache_there_is_no_redis_and_no_cache_url(tmp_path):
    stack = LocalStack(StackSettings(state_dir=tmp_path, response_cache=False))
    assert stack.names == ("kafka", "streams", "inference", "gateway")
    assert "--cache-url" not in stack.command("streams")
    with pytest.raises(StackError, match="redis runs with the response cache only") as exc:
        stack.up(["kafka", "redis"])
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "kafka").exists()  # refused before anything was prepared


def test_the_defaults_and_their_variables(tmp_path, monkeypatch):
    s = StackSettings(state_dir=tmp_path)
    assert (s.response_cache, s.redis_port, s.redis_maxmemory, s.redis_maxmemory_policy, s.redis_server) == \
        (True, 6379, "256mb", "allkeys-lru", "redis-server")
    monkeypatch.setenv("CHATPIPE_REDIS_PORT", "16390")
    monkeypatch.setenv("CHATPIPE_REDIS_MAXMEMORY", "1gb")
    monkeypatch.setenv("CHATPIPE_RESPONSE_CACHE", "false")
    s = StackSettings(state_dir=tmp_path)
    assert (s.redis_port, s.redis_maxmemory, s.response_cache) == (16390, "1gb", False)


def test_a_missing_redis_server_is_one_line_before_anything_starts(tmp_path):
    """Not a traceback from deep inside the supervisor: the line names the program, the package and the way
    to run without it."""
    stack = LocalStack(StackSettings(state_dir=tmp_path, redis_server="no-such-redis-server"))
    with pytest.raises(StackError) as exc:
        stack.up(["kafka", "redis"])
    message = str(exc.value)
    assert "'no-such-redis-server' not found" in message and "apt-get install redis-server" in message
    assert "--no-response-cache" in message and "\n" not in message
    assert not (tmp_path / "kafka").exists()
    # `--only streams` brings the workers' cache with them, so it is checked there too
    with pytest.raises(StackError, match="no-such-redis-server"):
        stack.up(["kafka", "streams"])
    # ... and not where no Redis is wanted
    assert stack.names[1] == "redis"
    LocalStack(StackSettings(state_dir=tmp_path, redis_server="no-such-redis-server"))._prepare_redis(["gateway"])


def test_its_port_is_checked_like_every_other(tmp_path):
    """Taken by another program (a system Redis on 6379, say): one line naming the port and the flag; and a
    worker's /metrics range over it is refused before anything starts."""
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        stack = LocalStack(StackSettings(state_dir=tmp_path, redis_port=port))
        with pytest.raises(PortInUseError, match=rf"port {port} on 127.0.0.1 \(redis\) .* --redis-port"):
            stack._check_ports(["redis"])
    assert "Debian's redis-server.service" in redis_server.ports(StackSettings(state_dir=tmp_path))[6379]
    with pytest.raises(StackError, match=r"port 6379 is Redis's \(--redis-port\) .* 6378-6380"):
        LocalStack(StackSettings(state_dir=tmp_path, worker_metrics_port=6378, inference_workers=3)).up()


def test_what_a_running_stack_needs_is_kept_and_guarded(tmp_path):
    """The port and the switch are in the streams workers' command line: neither may change under running
    workers; with the workers stopped `--no-response-cache` is how Redis is stopped (like a count)."""
    for name in ("response_cache", "redis_port", "redis_maxmemory", "redis_maxmemory_policy"):
        assert name in PERSISTED_FIELDS
    assert "redis" in PERSISTED_FIELDS["host"] and "redis_server" not in PERSISTED_FIELDS
    stack_state.save(StackSettings(state_dir=tmp_path, redis_port=16379, redis_maxmemory="32mb"),
                     ["kafka", "redis", "streams"])
    merged, services = stack_state.resolve(StackSettings(state_dir=tmp_path), running={"redis", "streams"})
    assert (merged.redis_port, merged.redis_maxmemory, merged.response_cache) == (16379, "32mb", True)
    assert "redis" in services
    with pytest.raises(stack_state.StackStateError, match="redis_port"):
        stack_state.resolve(StackSettings(state_dir=tmp_path, redis_port=16400), running={"streams"})
    with pytest.raises(stack_state.StackStateError, match="response_cache"):
        stack_state.resolve(StackSettings(state_dir=tmp_path, response_cache=False), running={"redis", "streams"})
    off, _ = stack_state.resolve(StackSettings(state_dir=tmp_path, response_cache=False), running={"redis"})
    assert off.response_cache is False and "redis" not in LocalStack(off).names


def test_a_redis_left_running_by_a_stack_with_the_cache_is_found_and_stopped_as_a_surplus(tmp_path):
    """After `up --no-response-cache` (workers stopped) a Redis that still runs is listed by `status` and
    stopped by `up` and `down`, as Jaeger is after `--no-observability`."""
    settings = StackSettings(state_dir=tmp_path, response_cache=False)
    settings.run_dir.mkdir(parents=True)
    (settings.run_dir / "redis.pid").write_text("999999 0\n")  # left by an earlier stack; not running
    stack = LocalStack(settings)
    assert "redis" not in stack.names and "redis" in stack._known()


@pytest.mark.parametrize("reply, expected", [(b"+PONG\r\n", ""), (b"-LOADING Redis is loading\r\n",
                                                                    "PING answers -LOADING Redis is loading")])
def test_health_is_a_pong_to_a_ping_on_a_plain_socket(tmp_path, reply, expected):
    """What `status` and `up` ask: a RESP PING, answered +PONG; anything else is said as it came."""
    import threading

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        received = []

        def answer():
            conn, _ = server.accept()
            with conn:
                received.append(conn.recv(64))
                conn.sendall(reply)

        thread = threading.Thread(target=answer)
        thread.start()
        assert redis_server.not_ready(StackSettings(state_dir=tmp_path, redis_port=port)) == expected
        thread.join(5)
    assert received == [b"*1\r\n$4\r\nPING\r\n"]
    closed = StackSettings(state_dir=tmp_path, redis_port=port)  # nothing listens there now
    assert redis_server.not_ready(closed) == "PING answers nothing"


def test_up_takes_the_flags(tmp_path):
    from typer.testing import CliRunner

    from chatpipe.cli import app

    out = " ".join(CliRunner().invoke(app, ["up", "--help"], terminal_width=200).output.split())
    assert "--response-cache / --no-response-cache" in out and "[env CHATPIPE_RESPONSE_CACHE; default true]" in out
    assert "--redis-port" in out and "[env CHATPIPE_REDIS_PORT; default 6379]" in out
    assert "redis (the response cache; with streams too)" in out
