"""The stack commands as a new user meets them: saved ports, clear one-line errors, help texts, ``-h``.

Each test here guards one rough edge found by trying ``chatpipe up/status/down/topics`` by hand;
they use the session's real broker (``kafka_stack``) and no model.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from chatpipe.testing.ports import free_port
from infra.settings import StackSettings

pytestmark = pytest.mark.integration


def _cli(*args: str, env_extra: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "chatpipe.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _row(table: str, name: str) -> str:
    """The text of ``name``'s row in a printed table, cell by cell (a wrapped row goes on below)."""
    lines = table.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith(f"│ {name} "))
    rows = [lines[i]] + [line for line in lines[i + 1:i + 4] if re.match(r"│\s+│", line)]
    cells = zip(*[[c.strip() for c in line.split("│")[1:-1]] for line in rows])
    return " | ".join(" ".join(part for part in cell if part) for cell in cells)


def _up_kafka_only(settings: StackSettings) -> subprocess.CompletedProcess:
    """`up --only kafka` on the session broker with its ports: writes the state folder's stack.json."""
    result = _cli("up", "--only", "kafka", "--state-dir", str(settings.state_dir),
                  "--kafka-port", str(settings.kafka_port), "--controller-port", str(settings.controller_port))
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_status_finds_the_ports_the_stack_was_started_with(kafka_stack):
    """`status` given only the state folder must find a broker on a non-default port (it once looked
    on 9092 and reported the running broker as stopped)."""
    _up_kafka_only(kafka_stack)
    saved = json.loads((Path(kafka_stack.state_dir) / "stack.json").read_text())
    assert saved["settings"]["kafka_port"] == kafka_stack.kafka_port
    result = _cli("status", env_extra={"CHATPIPE_STATE_DIR": str(kafka_stack.state_dir)})
    assert result.returncode == 0, result.stdout + result.stderr
    kafka_row = next(line for line in result.stdout.splitlines() if "kafka" in line and "healthy" in line)
    assert str(kafka_stack.kafka_port) in kafka_row


def test_second_up_without_ports_uses_the_saved_ones(kafka_stack):
    """`up` on a running stack given only the state folder must not wait for the broker on the
    default port (it once waited the whole start timeout, 90 s, then failed)."""
    _up_kafka_only(kafka_stack)
    result = _cli("up", "--only", "kafka", env_extra={"CHATPIPE_STATE_DIR": str(kafka_stack.state_dir),
                                                      "CHATPIPE_START_TIMEOUT_S": "15"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "already running" in result.stdout and str(kafka_stack.kafka_port) in result.stdout


def test_flags_that_contradict_the_running_stack_are_a_clear_error(kafka_stack):
    """A port flag that differs from the running broker's must fail in one line naming the setting,
    not report the stack as stopped or start a second one."""
    _up_kafka_only(kafka_stack)
    other = free_port()
    result = _cli("status", "--state-dir", str(kafka_stack.state_dir), "--kafka-port", str(other))
    assert result.returncode == 1
    assert f"kafka_port={other}" in result.stderr and str(kafka_stack.kafka_port) in result.stderr
    assert "Traceback" not in result.stderr


def test_a_state_folder_that_is_a_file_is_a_one_line_error(tmp_path):
    """`--state-dir` naming a file must give one clear line from every stack command, no traceback."""
    # A long path: the line is longer than any console width (rich once folded it in two).
    not_a_folder = tmp_path / ("a-long-folder-name-" * 6) / "state"
    not_a_folder.parent.mkdir()
    not_a_folder.write_text("oops")
    for command in ("up", "status", "down"):
        result = _cli(command, "--state-dir", str(not_a_folder))
        assert result.returncode == 1, (command, result.stdout, result.stderr)
        assert "is a file, not a folder" in result.stderr and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_topics_apply_without_a_broker_fails_fast_in_one_line():
    """No broker: `topics apply` must fail within seconds with one line naming the bootstrap servers
    (it once printed ~600 lines of librdkafka logs over 30 s first)."""
    servers = f"127.0.0.1:{free_port()}"
    result = _cli("topics", "apply", "--bootstrap-servers", servers, timeout=20)
    assert result.returncode == 1
    output = (result.stdout + result.stderr).strip().splitlines()
    assert len(output) == 1 and servers in output[0], output[:5]


@pytest.mark.parametrize("command, shown", [
    (["up"], "[env CHATPIPE_STATE_DIR; default .chatpipe]"),
    (["up"], "[env CHATPIPE_GATEWAY_PORT; default 8000]"),
    (["inference"], "[env CHATPIPE_WORKER_INTAKE; default partition]"),
    (["job", "finetune-dataset"], "[env CHATPIPE_SPARK_MASTER; default local[*]]"),
    (["topics", "apply"], "[env CHATPIPE_BOOTSTRAP_SERVERS; default 127.0.0.1:9092]"),
])
def test_help_shows_bracketed_env_and_defaults(command, shown):
    """The `[env ...; default ...]` of a help text must reach the reader (rich markup once ate every
    `[...]`, so no option said which variable sets it)."""
    result = _cli(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert shown in " ".join(result.stdout.split())  # help wraps long lines


@pytest.mark.parametrize("command", [[], ["status"], ["topics", "apply"], ["job", "finetune-dataset"]])
def test_dash_h_is_help_everywhere(command):
    """`-h` must print help like `--help` (it was "No such option: -h")."""
    result = _cli(*command, "-h")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Usage: ") and "Options:" in result.stdout


def test_a_service_that_dies_while_starting_is_named_with_its_log(kafka_stack):
    """`up` must say which service died and show the end of its log, not wait for it to get healthy;
    `status` must show it down with that exit. The worker is made to die by a model path that does not
    exist (the supervisor keeps restarting it with backoff until `chatpipe stop inference`)."""
    _up_kafka_only(kafka_stack)
    missing = kafka_stack.state_dir / "no-such-model"
    try:
        result = _cli("up", "--only", "inference", "--state-dir", str(kafka_stack.state_dir),
                      "--worker-metrics-port", str(free_port()), env_extra={"CHATPIPE_MODEL_PATH": str(missing)},
                      timeout=240)
        assert result.returncode == 1, result.stdout + result.stderr
        error = " ".join(result.stderr.split())
        assert "inference exited with code 1" in error and "logs/inference.log" in error
        assert "no-such-model" in error  # the worker's own message, from the log's last lines
        status = _cli("status", "--state-dir", str(kafka_stack.state_dir))
        assert status.returncode == 1 and "exited with code 1" in _row(status.stdout, "inference"), status.stdout
    finally:
        stop = _cli("stop", "inference", "--state-dir", str(kafka_stack.state_dir))
    assert stop.returncode == 0, stop.stdout + stop.stderr
