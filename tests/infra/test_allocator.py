"""infra/allocator.py: a process that runs our engine on CPU re-executes itself once with tcmalloc
preloaded, and what it starts does not inherit the preload. Real processes, real tcmalloc (Debian's
libtcmalloc-minimal4, which `make prerequisites` installs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from infra.allocator import tcmalloc
from infra.process_env import outside_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Re-executes itself through run_with_tcmalloc, then reports whether tcmalloc is mapped, how many times
# it started, and the environment a process it starts would get.
SCRIPT = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {repo!r})
    from infra.allocator import run_with_tcmalloc, tcmalloc_loaded
    from infra.process_env import outside_env
    starts = int(os.environ.get("STARTS", "0")) + 1
    os.environ["STARTS"] = str(starts)
    run_with_tcmalloc([__file__, *sys.argv[1:]], allocator=sys.argv[1])
    child = outside_env(os.environ)
    print(json.dumps({{"loaded": tcmalloc_loaded(), "starts": starts, "child_preload": child.get("LD_PRELOAD"),
                       "child_tried": "CHATPIPE_TCMALLOC_TRIED" in child, "thp": os.environ.get("THP_MEM_ALLOC_ENABLE"),
                       "child_thp": child.get("THP_MEM_ALLOC_ENABLE")}}))
""")


def run(tmp_path, allocator: str, **env: str) -> dict:
    script = tmp_path / "engine_process.py"
    script.write_text(SCRIPT.format(repo=REPO))
    clean = {k: v for k, v in os.environ.items()
             if k not in ("LD_PRELOAD", "CHATPIPE_SAVED_ENV", "CHATPIPE_TCMALLOC_TRIED", "THP_MEM_ALLOC_ENABLE")}
    done = subprocess.run([sys.executable, str(script), allocator], capture_output=True, text=True, timeout=60,
                          env={**clean, **env})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(tcmalloc() is None, reason="libtcmalloc-minimal4 not installed (`make prerequisites` installs it)")
def test_an_engine_process_reexecutes_once_with_tcmalloc_and_its_children_do_not_inherit_it(tmp_path):
    got = run(tmp_path, "tcmalloc", LD_PRELOAD="")
    assert got["loaded"] is True and got["starts"] == 2  # one re-execution, then it stays
    assert got["thp"] == "1"  # torch's 2 MB pages switch, on with it
    assert not got["child_preload"] and not got["child_tried"] and got["child_thp"] is None  # children: as before


@pytest.mark.skipif(tcmalloc() is None, reason="libtcmalloc-minimal4 not installed (`make prerequisites` installs it)")
def test_the_system_allocator_setting_runs_without_reexecuting(tmp_path):
    got = run(tmp_path, "system")
    assert got["loaded"] is False and got["starts"] == 1 and got["thp"] is None


def test_a_preload_that_did_not_take_does_not_loop(tmp_path):
    # A re-execution already tried (the marker is set) and tcmalloc is not loaded: it goes on without.
    got = run(tmp_path, "tcmalloc", CHATPIPE_TCMALLOC_TRIED="1")
    assert got["loaded"] is False and got["starts"] == 1


@pytest.mark.skipif(tcmalloc() is None, reason="libtcmalloc-minimal4 not installed (`make prerequisites` installs it)")
def test_an_explicit_huge_pages_setting_is_kept(tmp_path):
    got = run(tmp_path, "tcmalloc", THP_MEM_ALLOC_ENABLE="0")
    assert got["loaded"] is True and got["starts"] == 2 and got["thp"] == "0"


def test_outside_env_restores_the_first_values_of_twice_changed_variables():
    from infra.process_env import with_changes

    base = {"PATH": "/usr/bin", "LD_PRELOAD": "/lib/mine.so"}
    once = with_changes(base, {"LD_PRELOAD": "/lib/a.so:/lib/mine.so", "X": "1"})
    twice = with_changes(once, {"LD_PRELOAD": "/lib/b.so:/lib/a.so:/lib/mine.so"})
    assert outside_env(twice) == base
