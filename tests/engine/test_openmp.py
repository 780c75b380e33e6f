"""Giving back a thread's OpenMP team (inference/engine/openmp.py), in a fresh process each: the
threads a process has depend on everything that ran in it before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from chatpipe.testing.processes import REPO

SCRIPT = textwrap.dedent("""
    import json, os, sys, threading, torch
    from inference.engine.openmp import loaded_openmp, release_thread_pool
    torch.set_num_threads(2)
    a, w = torch.randn(64, 576), torch.randn(576, 1536)

    def threads():
        return len(os.listdir("/proc/self/task"))

    def sleeps():  # voluntary context switches of every thread of this process
        total = 0
        for t in os.listdir("/proc/self/task"):
            status = open(f"/proc/self/task/{t}/status").read()
            total += int(status.split("voluntary_ctxt_switches:")[1].split()[0])
        return total

    _ = a @ w  # the main thread's team, as when the model is loaded
    before = threads()
    released = release_thread_pool() if sys.argv[1] == "release" else False
    after = threads()
    result = {}

    def step_thread():  # as the engine's step thread: many short parallel regions
        for _ in range(200):
            _ = a @ w
        s0 = sleeps()
        for _ in range(2000):
            _ = a @ w
        result["sleeps"] = sleeps() - s0

    t = threading.Thread(target=step_thread)
    t.start()
    t.join()
    print(json.dumps({"library": loaded_openmp(), "released": released, "before": before, "after": after,
                      "sleeps": result["sleeps"]}))
""")


def run(mode: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, env=env, timeout=300,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_released_team_lets_the_step_threads_team_spin_instead_of_sleeping():
    kept, released = run("keep"), run("release")
    assert "libgomp" in (released["library"] or ""), released
    assert released["released"] is True
    assert released["after"] == released["before"] - 1, released  # the main thread's OpenMP worker is gone
    assert kept["after"] == kept["before"], kept
    # With two teams libgomp cuts the spin to 100 rounds: the step thread's team sleeps at nearly
    # every region. With one, it spins through the short gaps between regions.
    assert kept["sleeps"] > 1000, kept
    assert released["sleeps"] * 4 < kept["sleeps"], (kept, released)
