"""`chatpipe up --streams-workers N --inference-workers M`: what each instance is started with, the
settings kept for them, the errors for counts that cannot work, and (with cheap stand-in processes,
no model, no broker) that surplus instances are found and stopped and that the supervisor restarts an
instance by its name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from infra import stack_state, supervision as sv
from infra.instances import found_instances, instance_env, parse_instance
from infra.local_kafka import StackError
from infra.services import alive, write_pid_file
from infra.settings import StackSettings
from infra.stack import LocalStack

QDRANT = "http://127.0.0.1:6333"


def _arg(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_each_instance_gets_its_own_name_folder_and_port_and_shares_the_rest(tmp_path):
    """Instance 1 keeps the plain name and today's command (so `streams` / `inference` go on meaning what
    they did); the others must not share what one process owns (Faust's data folder, a /metrics port)
    and must share what the group splits (the archive, the Qdrant server, the broker)."""
    settings = StackSettings(state_dir=tmp_path, streams_workers=3, inference_workers=2, qdrant_url=QDRANT,
                             worker_metrics_port=9500)
    stack = LocalStack(settings)
    assert stack.names == ("kafka", "redis", "streams", "streams-2", "streams-3", "inference", "inference-2",
                           "gateway")

    streams = [stack.command(n) for n in ("streams", "streams-2", "streams-3")]
    assert [_arg(c, "--state-dir") for c in streams] == [str(tmp_path.resolve() / n)
                                                         for n in ("streams", "streams-2", "streams-3")]
    assert {_arg(c, "--archive-dir") for c in streams} == {str(tmp_path.resolve() / "archive")}
    assert {_arg(c, "--qdrant-url") for c in streams} == {QDRANT}
    assert all("--memory-path" not in c for c in streams)

    inference = [stack.command(n) for n in ("inference", "inference-2")]
    assert [_arg(c, "--metrics-port") for c in inference] == ["9500", "9501"]
    assert {_arg(c, "--bootstrap-servers") for c in streams + inference} == {settings.bootstrap_servers}
    assert "--group-id" not in inference[1]  # one group: the workers split its partitions
    assert stack.address("inference-2") == "http://127.0.0.1:9501/metrics"
    # each streams worker its own /metrics, the same group and Qdrant server
    assert [_arg(c, "--metrics-port") for c in streams] == ["9474", "9475", "9476"]
    assert stack.address("streams-3") == f"http://127.0.0.1:9476/metrics, group chatpipe-streams, qdrant {QDRANT}"
    assert stack.address("streams").split(", ", 1)[1] == stack.address("streams-3").split(", ", 1)[1]

    single = LocalStack(StackSettings(state_dir=tmp_path))
    assert single.names == ("kafka", "redis", "streams", "inference", "gateway")
    assert _arg(single.command("streams"), "--state-dir") == str(tmp_path.resolve() / "streams")


def test_instance_names_parse_one_way_only():
    """`streams-1` must not be a second name of `streams` (two pid files for one process)."""
    assert parse_instance("streams") == ("streams", 1) and parse_instance("inference-12") == ("inference", 12)
    assert [parse_instance(n) for n in ("streams-1", "streams-0", "gateway", "kafka", "streams-x")] == [None] * 5


def test_a_value_given_once_in_the_environment_is_made_unique_per_instance(tmp_path, monkeypatch):
    """A web port or a worker id set for `up` would otherwise be taken by every instance at once."""
    monkeypatch.setenv("CHATPIPE_STREAMS_WEB_PORT", "6070")
    monkeypatch.setenv("CHATPIPE_WORKER_WORKER_ID", "box-a")
    monkeypatch.setenv("CHATPIPE_MAX_BATCH", "8")
    stack = LocalStack(StackSettings(state_dir=tmp_path, streams_workers=2, inference_workers=2, qdrant_url=QDRANT))
    env = {name: stack._service_spec(name).env for name in stack.names[1:]}
    assert env["streams"]["CHATPIPE_STREAMS_WEB_PORT"] == "6070" and env["streams-2"]["CHATPIPE_STREAMS_WEB_PORT"] == "6071"
    assert env["inference"]["CHATPIPE_WORKER_WORKER_ID"] == "box-a"
    assert env["inference-2"]["CHATPIPE_WORKER_WORKER_ID"] == "box-a-2"
    assert {e["CHATPIPE_MAX_BATCH"] for e in env.values()} == {"8"}  # the rest is up's environment, as before
    assert instance_env("inference-2", {}) == {} and instance_env("gateway", dict(os.environ)) == {}


def test_counts_that_cannot_work_are_one_line_before_anything_starts(tmp_path):
    """Several streams workers cannot share Qdrant local mode (one process opens the folder); a worker's
    /metrics port on the gateway's port would fail late, inside the worker."""
    with pytest.raises(StackError, match=r"--streams-workers 2 needs a Qdrant server: give --qdrant-url") as exc:
        LocalStack(StackSettings(state_dir=tmp_path, streams_workers=2)).up()
    assert "\n" not in str(exc.value)
    with pytest.raises(StackError, match=r"port 8000 is the gateway's .* 7999-8001"):
        LocalStack(StackSettings(state_dir=tmp_path, worker_metrics_port=7999, inference_workers=3)).up()
    assert not (tmp_path / "kafka").exists()  # refused before the broker was prepared
    with pytest.raises(StackError, match=r"port 9464 is an inference worker's /metrics port .* streams worker's "
                                         r"/metrics port .* 9463-9464"):
        LocalStack(StackSettings(state_dir=tmp_path, streams_metrics_port=9463, streams_workers=2,
                                 qdrant_url=QDRANT)).up()
    # `--only kafka,inference` starts no streams worker: no Qdrant server needed for it
    with pytest.raises(StackError, match="gateway"):
        LocalStack(StackSettings(state_dir=tmp_path, streams_workers=2, worker_metrics_port=7999,
                                 inference_workers=3)).up(["kafka", "inference"])


def test_worker_counts_are_kept_and_may_change_while_the_stack_runs(tmp_path):
    """`status` and `down` must know how many workers run without being told; `up` with another count is
    how the stack scales, so it is no clash, while another Qdrant URL under a running streams-2 is."""
    stack_state.save(StackSettings(state_dir=tmp_path, streams_workers=2, inference_workers=3, qdrant_url=QDRANT),
                     ["kafka", "streams", "streams-2", "inference", "inference-2", "inference-3"])
    merged, services = stack_state.resolve(StackSettings(state_dir=tmp_path), running={"streams-2"})
    assert (merged.streams_workers, merged.inference_workers) == (2, 3) and "inference-3" in services
    smaller, _ = stack_state.resolve(StackSettings(state_dir=tmp_path, inference_workers=1),
                                     running={"inference", "inference-2", "inference-3"})
    assert smaller.inference_workers == 1
    with pytest.raises(stack_state.StackStateError, match="qdrant_url"):
        stack_state.resolve(StackSettings(state_dir=tmp_path, qdrant_url="http://other:6333"), running={"streams-2"})


def test_unknown_instance_names_say_how_to_get_them(tmp_path):
    from chatpipe.commands.stack import _parse_names

    stack = LocalStack(StackSettings(state_dir=tmp_path, streams_workers=2, qdrant_url=QDRANT))
    assert _parse_names(["gateway", "streams-2", "kafka"], stack) == ["kafka", "streams-2", "gateway"]
    with pytest.raises(StackError, match=r"no service streams-3; choose from .*streams-2.*--streams-workers N"):
        _parse_names(["streams-3"], stack)


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)


def test_an_instance_beyond_the_count_is_listed_found_and_stopped(tmp_path):
    """After `up --inference-workers 1` on a stack that ran 3, the surplus must not run on unseen: `status`
    lists what still runs, `up` stops it (SIGTERM), `down` would too."""
    settings = StackSettings(state_dir=tmp_path)
    settings.run_dir.mkdir(parents=True)
    proc = _sleeper()
    try:
        write_pid_file(settings.run_dir / "inference-3.pid", proc.pid)
        (settings.run_dir / "streams-2.pid").write_text("999999 1\n")  # a stale file: not running
        stack = LocalStack(settings)
        assert found_instances(settings.run_dir) == {"inference-3", "streams-2"}
        assert stack.running_services() == {"inference-3"}
        assert [h.name for h in stack.status()] == ["kafka", "redis", "streams", "inference", "gateway",
                                                    "inference-3"]
        assert stack._surplus() == ["inference-3"]
        stopped = []
        stack._retire(stack._surplus(), stopped.append)
        assert [(r.name, r.outcome, r.pid) for r in stopped] == [("inference-3", "stopped", proc.pid)]
        proc.wait(timeout=10)  # its status was reaped by the stop's liveness check: gone is what counts
        assert stack._surplus() == [] and stack.running_services() == set()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_supervisor_restarts_an_instance_by_its_name(tmp_path):
    """The supervisor is driven by the spec's names alone: `streams-2` killed by SIGKILL must come back
    with a new pid and restarts 1, and `inference-2` held stopped must stay stopped."""
    settings = StackSettings(state_dir=tmp_path)
    client = sv.SupervisorClient(settings)
    sleep = (sys.executable, "-c", "import time; time.sleep(120)")
    env = dict(os.environ)

    def add(spec, supervisor_runs):
        for name in ("streams-2", "inference-2"):
            spec = spec.put(sv.ServiceSpec(name, sleep, env, str(settings.logs_dir / f"{name}.log"),
                                           str(settings.run_dir / f"{name}.pid")), ())
        return spec

    supervisor_pid = None
    try:
        new, started = client.update(add)
        assert started
        client.wait_applied(new.revision)
        supervisor_pid = client.pid()
        first = client.state().services["streams-2"].pid
        new, _ = client.update(lambda spec, runs: spec.wanting(["inference-2"], False))
        client.wait_applied(new.revision)
        assert client.wait_stopped("inference-2", 20).state == "stopped"
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (record := client.state().services["streams-2"]).restarts < 1 or record.state != "running":
            assert time.monotonic() < deadline, record
            time.sleep(0.1)
        assert record.pid != first and alive(record.pid) and record.last_exit.reason == "killed by SIGKILL"
        assert LocalStack(settings).running_services() == {"streams-2"}
        assert client.state().services["inference-2"].state == "stopped"
    finally:
        pid = supervisor_pid or client.pid()
        if pid is not None:
            os.kill(pid, signal.SIGTERM)  # stops every service it runs, then exits
            deadline = time.monotonic() + 30
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
    assert not alive(pid)
    assert client.state().services["streams-2"].state == "stopped"
