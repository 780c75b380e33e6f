"""The supervisor of `chatpipe up` on real processes: Kafka and the gateway (no model), on free ports in a
temporary state folder, driven through the CLI as a user or a fault test would.

Guards: a service that exits, by SIGKILL or by crashing, is started again with backoff and `status`
says how often and why; a deliberate `restart` / `stop` is not fought by the supervisor; `down` and
SIGTERM to the supervisor leave no process behind; a stack without a supervisor still works.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from chatpipe.testing.ports import free_port
from infra.services import alive

pytestmark = pytest.mark.integration


def _cli(*args: str, env_extra: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "250", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "chatpipe.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _flags(state: Path) -> list[str]:
    return ["--state-dir", str(state), "--kafka-port", str(free_port()), "--controller-port", str(free_port()),
            "--gateway-port", str(free_port())]


def _pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (FileNotFoundError, ValueError, IndexError):
        return None


class Stack:
    """Paths and reads of one state folder; every pid it has seen, to check that none is left."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.seen: set[int] = set()

    def pid(self, name: str) -> int | None:
        path = {"kafka": self.state / "kafka" / "broker.pid"}.get(name, self.state / "run" / f"{name}.pid")
        pid = _pid(path)
        if pid is not None:
            self.seen.add(pid)
        return pid

    def record(self, name: str) -> dict:
        return json.loads((self.state / "run" / "supervisor.json").read_text())["services"][name]

    def status(self) -> subprocess.CompletedProcess:
        return _cli("status", "--state-dir", str(self.state))

    def row(self, status: subprocess.CompletedProcess, name: str) -> list[str]:
        """The cells of ``name``'s row in the service table (a wrapped row continues on the next lines)."""
        lines = status.stdout.splitlines()
        i = next(i for i, line in enumerate(lines) if re.search(rf"│ {name}\s+│", line))
        rows = [lines[i]] + [line for line in lines[i + 1:i + 4] if re.match(r"│\s+│", line)]
        cells = [[c.strip() for c in line.split("│")[1:-1]] for line in rows]
        return [" ".join(part for part in column if part) for column in zip(*cells)]

    def wait_for(self, what: str, check, timeout_s: float = 90.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (value := check()):
                return value
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}; supervisor log:\n"
                             f"{(self.state / 'logs' / 'supervisor.log').read_text()[-3000:]}")

    def healthy(self, port: int) -> bool:
        try:
            with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                    f"http://127.0.0.1:{port}/healthz", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    def leftovers(self) -> list[str]:
        """Live processes that belong to this state folder: pids seen, or its path on their command line."""
        found = [f"pid {pid}" for pid in self.seen if alive(pid)]
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if str(self.state) in cmdline and alive(int(proc.name)):
                found.append(f"pid {proc.name}: {cmdline.replace(chr(0), ' ')[:200]}")
        return found

    def down(self) -> subprocess.CompletedProcess:
        for name in ("supervisor", "kafka", "gateway"):
            self.pid(name)
        return _cli("down", "--state-dir", str(self.state), timeout=300)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Kafka + gateway under the supervisor, for the tests below in file order; `down` at the end."""
    state = tmp_path_factory.mktemp("supervised") / "state"
    flags = _flags(state)
    up = _cli("up", "--only", "kafka,gateway", *flags)
    assert up.returncode == 0, up.stdout + up.stderr
    s = Stack(state)
    s.gateway_port = int(flags[flags.index("--gateway-port") + 1])
    s.up_output = up.stdout
    yield s
    s.down()
    assert s.leftovers() == []


def test_up_puts_the_services_under_a_detached_supervisor(stack):
    """`up` must return with Kafka and the gateway running as children of one supervisor process
    (pid in run/, log in logs/), not of `up` itself, which has exited."""
    supervisor = stack.pid("supervisor")
    assert supervisor is not None and alive(supervisor), stack.up_output
    assert f"supervisor: pid {supervisor}" in stack.up_output
    for name in ("kafka", "gateway"):
        parent = int(Path(f"/proc/{stack.pid(name)}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert parent == supervisor, f"{name}'s parent is {parent}, not the supervisor {supervisor}"
    assert "gateway: start: pid" in (stack.state / "logs" / "supervisor.log").read_text()


def test_a_sigkilled_gateway_is_restarted_healthy_and_status_shows_why(stack):
    """SIGKILL to a service must bring a new process (new pid) that gets healthy again within seconds,
    and `status` must show restarts 1 and the signal."""
    old = stack.pid("gateway")
    os.kill(old, signal.SIGKILL)
    new = stack.wait_for("a new gateway pid", lambda: (p := stack.pid("gateway")) not in (None, old) and alive(p) and p)
    stack.wait_for("the new gateway to answer /healthz 200", lambda: stack.healthy(stack.gateway_port))
    status = stack.status()
    assert status.returncode == 0, status.stdout + status.stderr
    service, health, pid, restarts, last_exit, *_ = stack.row(status, "gateway")
    assert (health, pid, restarts) == ("healthy", str(new), "1"), status.stdout
    assert last_exit.startswith("killed by SIGKILL"), last_exit
    exit_ = stack.record("gateway")["exits"][-1]
    assert exit_["signal"] == "SIGKILL" and not exit_["requested"] and exit_["restart_at"] >= exit_["at"]
    as_json = _cli("status", "--json", "--state-dir", str(stack.state))  # what scripts and the fault tests read
    assert as_json.returncode == 0, as_json.stdout + as_json.stderr
    gateway = next(s for s in json.loads(as_json.stdout)["services"] if s["name"] == "gateway")
    assert (gateway["pid"], gateway["restarts"], gateway["last_exit"]["signal"]) == (new, 1, "SIGKILL")


def test_a_sigkilled_broker_is_restarted(stack):
    """The broker is supervised too: SIGKILL to it must bring up a new broker that answers, and the
    gateway stays or gets healthy again."""
    old = stack.pid("kafka")
    os.kill(old, signal.SIGKILL)
    stack.wait_for("a new broker pid", lambda: (p := stack.pid("kafka")) not in (None, old) and alive(p))
    status = stack.wait_for("kafka healthy in `status`",
                            lambda: (st := stack.status()) and "healthy" == stack.row(st, "kafka")[1] and st)
    _, _, _, restarts, last_exit, *_ = stack.row(status, "kafka")
    assert restarts == "1" and last_exit.startswith("killed by SIGKILL"), status.stdout
    stack.wait_for("the gateway to answer after the broker's restart", lambda: stack.healthy(stack.gateway_port))


def test_restart_and_stop_on_request_are_not_fought_or_counted(stack):
    """`chatpipe restart kafka` must give a new broker without counting a restart; `chatpipe stop gateway`
    must keep the gateway down (longer than any backoff) until `up --only gateway` starts it again."""
    before = stack.record("kafka")["restarts"]
    old = stack.pid("kafka")
    restart = _cli("restart", "kafka", "--state-dir", str(stack.state))
    assert restart.returncode == 0, restart.stdout + restart.stderr
    assert stack.pid("kafka") not in (None, old) and stack.record("kafka")["restarts"] == before
    assert stack.record("kafka")["exits"][-1]["requested"]

    gateway = stack.pid("gateway")
    stop = _cli("stop", "gateway", "--state-dir", str(stack.state))
    assert stop.returncode == 0 and f"gateway   stopped (SIGTERM): pid {gateway}" in stop.stdout, stop.stdout + stop.stderr
    time.sleep(3.0)  # longer than the first backoffs (1 s, 2 s)
    assert not alive(gateway) and stack.pid("gateway") is None
    status = stack.status()
    assert status.returncode == 1 and "by `chatpipe stop`" in stack.row(status, "gateway")[1], status.stdout

    up = _cli("up", "--only", "gateway", "--state-dir", str(stack.state))
    assert up.returncode == 0 and "gateway   started" in up.stdout, up.stdout + up.stderr
    assert stack.healthy(stack.gateway_port)


def test_a_second_up_changes_nothing(stack):
    """`up` on the running supervised stack must say "already running" for each and keep every pid."""
    pids = {name: stack.pid(name) for name in ("supervisor", "kafka", "gateway")}
    again = _cli("up", "--only", "kafka,gateway", "--state-dir", str(stack.state))
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.count("already running") == 2
    assert {name: stack.pid(name) for name in pids} == pids


def test_up_after_the_supervisor_was_killed_takes_over_what_runs(stack):
    """A SIGKILLed supervisor leaves its services running; `status` must say nothing restarts them, and
    the next `up` must start a supervisor that adopts them (same pids) and restarts them when they go."""
    supervisor, gateway, kafka = stack.pid("supervisor"), stack.pid("gateway"), stack.pid("kafka")
    os.kill(supervisor, signal.SIGKILL)
    stack.wait_for("the supervisor to be gone", lambda: not alive(supervisor))
    status = stack.status()
    assert "supervisor: not running" in status.stdout and stack.row(status, "gateway")[1] == "healthy", status.stdout

    up = _cli("up", "--only", "kafka,gateway", "--state-dir", str(stack.state))
    assert up.returncode == 0, up.stdout + up.stderr
    assert stack.pid("supervisor") not in (None, supervisor)
    assert (stack.pid("gateway"), stack.pid("kafka")) == (gateway, kafka)
    os.kill(gateway, signal.SIGKILL)
    stack.wait_for("a new gateway pid", lambda: stack.pid("gateway") not in (None, gateway))
    stack.wait_for("the new gateway to answer", lambda: stack.healthy(stack.gateway_port))


def test_down_stops_the_supervisor_first_and_leaves_no_process(stack):
    """`down` must stop the supervisor before the services (none is restarted while they stop), stop
    each with SIGTERM alone, and leave no process of the state folder running."""
    down = stack.down()
    assert down.returncode == 0, down.stdout + down.stderr
    lines = down.stdout.splitlines()
    assert lines[0].startswith("supervisor stopped: pid"), down.stdout
    for name in ("gateway", "kafka"):
        assert "stopped (SIGTERM)" in next(line for line in lines if line.startswith(name)), down.stdout
    assert stack.leftovers() == []
    assert "start: pid" not in (stack.state / "logs" / "supervisor.log").read_text().split("released")[-1]
    after = stack.status()
    assert after.returncode == 1 and stack.row(after, "gateway")[1] == "stopped", after.stdout


def test_a_crash_looping_service_is_restarted_with_growing_delays(tmp_path):
    """A gateway that exits at once on every start (an invalid CHATPIPE_GATEWAY_MAX_PENDING in the
    environment of `up`, which the service must get) makes `up` fail naming it with its log, and the
    supervisor restart it after 0.5, 1, 2, 2 s (backoff doubling to its cap), not in a tight loop."""
    stack = Stack(tmp_path / "state")
    env = {"CHATPIPE_GATEWAY_MAX_PENDING": "0", "CHATPIPE_RESTART_BACKOFF_S": "0.5",
           "CHATPIPE_RESTART_BACKOFF_MAX_S": "2"}
    try:
        up = _cli("up", "--only", "kafka,gateway", *_flags(stack.state), env_extra=env)
        assert up.returncode == 1, up.stdout + up.stderr
        error = " ".join(up.stderr.split())
        assert "gateway exited with code 1 while starting" in error and "max_pending" in error, error
        stack.wait_for("5 restarts", lambda: stack.record("gateway")["restarts"] >= 5, timeout_s=120)
        exits = stack.record("gateway")["exits"]
        gaps = [e["restart_at"] - e["at"] for e in exits if e["restart_at"] is not None][:5]
        assert [e["delay_s"] for e in exits[:5]] == [0.5, 1.0, 2.0, 2.0, 2.0]
        for gap, delay in zip(gaps, [0.5, 1.0, 2.0, 2.0, 2.0]):
            assert delay <= gap < delay + 1.5, gaps
        assert all(e["code"] == 1 and "max_pending" in "\n".join(e["log_tail"]) for e in exits)
        status = stack.status()
        assert status.returncode == 1, status.stdout
        _, health, _, restarts, last_exit, *_ = stack.row(status, "gateway")
        assert int(restarts) >= 5 and last_exit.startswith("exited with code 1"), status.stdout
    finally:
        stack.down()
    assert stack.leftovers() == []


def test_sigterm_to_the_supervisor_stops_every_service(tmp_path):
    """SIGTERM to the supervisor itself must stop the services (SIGTERM each, in reverse order) and then
    the supervisor, leaving no process; `status` then says nothing runs."""
    stack = Stack(tmp_path / "state")
    try:
        up = _cli("up", "--only", "kafka,gateway", *_flags(stack.state))
        assert up.returncode == 0, up.stdout + up.stderr
        supervisor, kafka, gateway = stack.pid("supervisor"), stack.pid("kafka"), stack.pid("gateway")
        os.kill(supervisor, signal.SIGTERM)
        stack.wait_for("the supervisor to exit", lambda: not alive(supervisor), timeout_s=60)
        assert not alive(kafka) and not alive(gateway)
        state = json.loads((stack.state / "run" / "supervisor.json").read_text())
        assert state["phase"] == "stopped"
        assert [state["services"][n]["exits"][-1]["requested"] for n in ("kafka", "gateway")] == [True, True]
        log = (stack.state / "logs" / "supervisor.log").read_text()
        assert log.index("gateway: shutting down") < log.index("kafka: shutting down")
        status = stack.status()
        assert status.returncode == 1 and "supervisor: not running" in status.stdout, status.stdout
    finally:
        stack.down()
    assert stack.leftovers() == []


def test_a_stack_started_without_a_supervisor_still_works(tmp_path):
    """A broker started the old way (no supervisor: an older chatpipe, a test fixture) must show in
    `status`, be left alone by `up` (no supervisor adopts it) and be stopped by `down`."""
    from infra.local_kafka import LocalKafka
    from infra.settings import StackSettings

    settings = StackSettings(state_dir=tmp_path / "state", kafka_port=free_port(), controller_port=free_port())
    kafka = LocalKafka(settings)
    kafka.up()
    stack = Stack(settings.state_dir)
    flags = ["--state-dir", str(settings.state_dir), "--kafka-port", str(settings.kafka_port),
             "--controller-port", str(settings.controller_port)]
    try:
        up = _cli("up", "--only", "kafka", *flags)
        assert up.returncode == 0 and "already running" in up.stdout, up.stdout + up.stderr
        assert stack.pid("supervisor") is None and "not supervised: kafka" in up.stdout
        status = _cli("status", "--state-dir", str(settings.state_dir))
        assert status.returncode == 0 and stack.row(status, "kafka")[1] == "healthy", status.stdout
        restart = _cli("restart", "kafka", "--state-dir", str(settings.state_dir))
        assert restart.returncode == 1 and "runs without the supervisor" in restart.stderr
    finally:
        down = stack.down()
    assert down.returncode == 0 and "supervisor was not running" in down.stdout, down.stdout + down.stderr
    assert "stopped (SIGTERM)" in next(line for line in down.stdout.splitlines() if line.startswith("kafka"))
    assert kafka.pid() is None and stack.leftovers() == []
