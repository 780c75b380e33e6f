"""`chatpipe up/down/status` on the real broker: idempotent start, clear errors, clean stop."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from infra.local_kafka import BrokerStartError, LocalKafka, PortInUseError
from infra.settings import StackSettings

pytestmark = pytest.mark.integration


def _cli(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "chatpipe.cli", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def _stack_flags(settings: StackSettings) -> list[str]:
    return ["--state-dir", str(settings.state_dir), "--kafka-port", str(settings.kafka_port),
            "--controller-port", str(settings.controller_port)]


def test_second_up_changes_nothing(kafka_stack):
    """`up` on a running stack must neither start a second broker nor change any topic."""
    kafka = LocalKafka(kafka_stack)
    pid = kafka.pid()
    first = _cli("up", "--only", "kafka", *_stack_flags(kafka_stack))
    assert first.returncode == 0, first.stderr
    second = _cli("up", "--only", "kafka", *_stack_flags(kafka_stack))
    assert second.returncode == 0, second.stderr
    assert "already running" in second.stdout
    assert "0 change(s)" in second.stdout
    assert kafka.pid() == pid


def test_status_shows_broker_ports_and_topic_offsets(kafka_stack):
    """`status` must show the broker, its port, and the catalog topics with partitions and offsets."""
    _cli("up", "--only", "kafka", *_stack_flags(kafka_stack))
    result = _cli("status", *_stack_flags(kafka_stack))
    assert result.returncode == 0, result.stderr
    assert "healthy" in result.stdout and str(kafka_stack.kafka_port) in result.stdout
    assert "chat.turns" in result.stdout and "chat.dlq" in result.stdout


def test_port_in_use_gives_clear_error(tmp_path):
    """A port taken by another program must fail fast with a message naming the port, not hang."""
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        settings = StackSettings(state_dir=tmp_path, kafka_port=port, controller_port=port + 1 if port < 65535 else 1)
        with pytest.raises(PortInUseError, match=str(port)):
            LocalKafka(settings).up()
        result = _cli("up", "--only", "kafka", *_stack_flags(settings))
    assert result.returncode == 1
    assert f"port {port}" in result.stderr and "Traceback" not in result.stderr


def test_broker_that_fails_to_start_shows_its_log(tmp_path):
    """When the JVM dies at start, the error must include the last lines of the broker's log."""
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        ports = a.getsockname()[1], b.getsockname()[1]
    settings = StackSettings(state_dir=tmp_path, kafka_port=ports[0], controller_port=ports[1],
                             kafka_heap="not-a-size")
    with pytest.raises(BrokerStartError) as info:
        LocalKafka(settings).up()
    message = str(info.value)
    assert "exited" in message and "heap" in message.lower()
    assert LocalKafka(settings).pid() is None


def test_cluster_id_starting_with_a_dash_formats(tmp_path):
    """A random base64 cluster id starts with '-' one time in 64; `up` once failed on it because
    the storage tool read the id as a flag."""
    from infra.local_kafka import ensure_jars

    settings = StackSettings(state_dir=tmp_path)
    kafka = LocalKafka(settings)
    kafka.logs_dir.mkdir(parents=True)
    kafka._format_storage(ensure_jars(settings), kafka._write_config(), cluster_id="-" + "A" * 21)
    assert "cluster.id=-" + "A" * 21 in (kafka.data_dir / "meta.properties").read_text()


def test_down_when_not_running_is_harmless(tmp_path):
    """`down` without a broker must say so and exit 0 (scripts call it unconditionally)."""
    result = _cli("down", "--state-dir", str(tmp_path))
    assert result.returncode == 0 and "not running" in result.stdout
