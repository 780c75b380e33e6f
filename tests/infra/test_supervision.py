"""The supervisor's restart policy and the commands' side of its files (``infra.supervision``), and what
``chatpipe up`` hands it to run: plain logic and files, no processes."""

from __future__ import annotations

import json
import stat

from infra import stack_state, supervision as sv
from infra.settings import StackSettings
from infra.stack import LocalStack


def test_backoff_doubles_to_its_cap_and_resets_after_a_long_run():
    """A crash loop must wait 1, 2, 4 ... s up to the cap, never in a tight loop; a service that ran
    longer than the reset time and then exits is restarted after the first delay again."""
    backoff = sv.Backoff(initial_s=1.0, max_s=8.0, reset_after_s=60.0)
    assert [backoff.next_delay(ran_s=0.5) for _ in range(6)] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert backoff.next_delay(ran_s=61.0) == 1.0
    assert backoff.next_delay(ran_s=2.0) == 2.0


def test_exit_status_reads_as_code_or_signal():
    """`status` must tell a crash (code) from a kill (signal): Popen's -9 is SIGKILL, not code -9."""
    assert sv.exit_reason(-9) == ("killed by SIGKILL", None, "SIGKILL")
    assert sv.exit_reason(1) == ("exited with code 1", 1, None)
    # streams' own codes (docs/architecture.md): an outage past the retry budget is not a bug
    assert sv.exit_reason(75) == ("exited with code 75 (infrastructure away past the retry budget, or a stalled or lost delivery)", 75, None)
    assert sv.happened("gateway", "killed by SIGKILL") == "gateway was killed by SIGKILL"


def test_spec_round_trips_keeps_stack_order_and_is_private(tmp_path):
    """The spec carries each service's whole environment, so it must be readable only by its owner; services
    are kept in start order whatever order `up` adds them in (the supervisor stops them in reverse)."""
    settings = StackSettings(state_dir=tmp_path)
    client = sv.SupervisorClient(settings)

    def add(spec, supervisor_runs):
        for name in ("gateway", "kafka"):  # wanted=False: nothing to run, so no supervisor is started
            spec = spec.put(sv.ServiceSpec(name, ("true",), {"SECRET": "x"}, "log", "pid", wanted=False),
                            ("kafka", "gateway"))
        return spec

    spec, started = client.update(add)
    assert not started and client.pid() is None
    assert [s.name for s in client.spec().services] == ["kafka", "gateway"]
    assert client.spec() == spec and spec.revision == 1
    path = settings.run_dir / sv.SPEC_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and json.loads(path.read_text())["revision"] == 1


def test_streams_gets_the_qdrant_url_instead_of_local_mode(tmp_path):
    """`up --qdrant-url` must start streams with `--qdrant-url` (and no `--memory-path`), keep the URL with
    the state folder like a port, and `--qdrant-url ''` must go back to local mode."""
    url = "http://127.0.0.1:6333"
    stack = LocalStack(StackSettings(state_dir=tmp_path, qdrant_url=url))
    command = stack.command("streams")
    assert command[command.index("--qdrant-url") + 1] == url and "--memory-path" not in command
    assert "--memory-path" in LocalStack(StackSettings(state_dir=tmp_path)).command("streams")

    stack_state.save(stack.settings, ["kafka", "streams"])
    merged, _ = stack_state.resolve(StackSettings(state_dir=tmp_path), running=set())
    assert merged.qdrant_url == url
    local, _ = stack_state.resolve(StackSettings(state_dir=tmp_path, qdrant_url=""), running=set())
    assert local.qdrant_url is None
