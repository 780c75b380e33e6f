"""bench/profile_step.py (issue 22) on CPU with the tiny shape: the step profile prints every cost
bucket, both step kinds, the markdown summary and the bench headline; and bench/gpu_check.sh
refuses a bad part list at once (before it could spend device time)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script_buckets() -> tuple[str, ...]:
    """The buckets the script declares, read from its source: importing it would put bench/ on
    sys.path, where bench/capacity.py would shadow the capacity package for later tests."""
    import ast

    tree = ast.parse((ROOT / "bench" / "profile_step.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "BUCKETS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("bench/profile_step.py declares no BUCKETS")


BUCKETS = _script_buckets()


def test_profile_step_quick_prints_the_buckets_and_the_headline():
    cmd = [sys.executable, "bench/profile_step.py", "--quick", "--device", "cpu", "--shapes", "tiny",
           "--batch", "4", "--context", "48", "--chunk", "40", "--warmup", "1", "--reps", "2", "--profile-runs", "1"]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert "== tiny decode step, " in out and "== tiny mixed step, " in out and "one 40-token prompt chunk" in out
    rows = {}
    for line in out.splitlines():
        if line.startswith("| "):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    assert [c.split(" (")[0] for c in rows[""]] == ["tiny decode", "tiny mixed"]  # "tiny decode (hf)": the layers' path
    for name in BUCKETS:
        assert name in rows, f"bucket {name!r} missing from the markdown summary:\n{out}"
        table_rows = [line for line in out.splitlines() if re.match(re.escape(name) + r"\s+\d", line)]
        assert len(table_rows) == 2, (name, table_rows)  # one bucket-table row per step
    calls = {name: [int(re.search(r"\((\d+)", c).group(1)) for c in rows[name]] for name in BUCKETS if name != "Python outside ops"}
    for name in ("GEMMs", "KV write (index_copy_)", "HF submodule kernels per layer", "host->device tensor builds"):
        assert min(calls[name]) > 0, (name, calls[name])
    # the decode rows attend through the C kernel (paged_kernel auto on CPU), one call per layer and step;
    # the mixed step's prompt chunk gathers its context and runs SDPA
    assert calls["paged decode kernel"][0] == calls["paged decode kernel"][1] > 0, calls["paged decode kernel"]
    assert calls["SDPA"][0] == calls["KV gather (index_select) in attention"][0] == 0, calls
    assert calls["SDPA"][1] > 0 and calls["KV gather (index_select) in attention"][1] > 0, calls
    assert rows["syncs: item / tolist / cuda*Synchronize"][0].split(" / ")[1] == "1"  # the sampler's tolist
    last = out.strip().splitlines()[-1]
    m = re.fullmatch(r"profile/decode step tiny ms = (\d+\.\d+)", last)
    assert m and float(m.group(1)) > 0, last


def test_gpu_check_refuses_an_unknown_part_at_once():
    run = subprocess.run(["bash", "bench/gpu_check.sh", "run", "exactness,bogus"], cwd=ROOT, capture_output=True,
                         text=True, timeout=30)  # fmt: skip
    assert run.returncode == 1
    assert "gpu_check: FAILED: unknown part 'bogus'" in run.stderr
    assert subprocess.run(["bash", "-n", "bench/gpu_check.sh"], cwd=ROOT).returncode == 0
