"""The jobs on a real Spark standalone cluster (master + 2 workers on loopback) give the same
outputs as in local mode, with the project's code and jars shipped the way a cluster needs.

The workers run with no PYTHONPATH and a working folder outside this checkout; the venv's
editable install could still import the project on an executor, so the executor-side check
asserts where the code came from: the zip the job shipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.spark


def _chatpipe(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "chatpipe.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, f"chatpipe {' '.join(args)} failed:\n{proc.stderr[-4000:]}"
    return proc


def _files(root: Path, pattern: str) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob(pattern))}


def test_cluster_is_up_with_two_workers_and_a_clean_environment(spark_cluster):
    """Catches workers that never registered, and daemons that inherit PYTHONPATH or run in this
    checkout (either would let executors find the project without it being shipped)."""
    status = spark_cluster.status()
    assert status.master_alive and status.master_url == spark_cluster.master_url()
    assert [w.registered for w in status.workers] == [True, True]
    assert all(w.cores == 1 and w.memory_mb == 1024 for w in status.workers)
    for pid in [status.master_pid] + [w.pid for w in status.workers]:
        env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
        assert "PYTHONPATH" not in env
        assert not Path(os.readlink(f"/proc/{pid}/cwd")).is_relative_to(REPO)


def test_cli_status_url_and_a_second_up(spark_cluster):
    """Catches `chatpipe spark status` not showing the master URL and registered workers, `url`
    printing another master, and a second `up` starting a second cluster instead of reusing it."""
    state = str(spark_cluster.settings.state_dir)
    before = spark_cluster.status()
    status = _chatpipe("spark", "status", "--state-dir", state).stdout
    assert before.master_url in status and status.count("registered") == 2
    assert _chatpipe("spark", "url", "--state-dir", state).stdout.strip() == before.master_url
    assert "already running" in _chatpipe("spark", "up", "--state-dir", state).stdout
    after = spark_cluster.status()
    assert (after.master_pid, [w.pid for w in after.workers]) == (before.master_pid, [w.pid for w in before.workers])


def test_executors_run_the_venv_python_and_the_shipped_code(spark_cluster, tmp_path):
    """Catches executors importing the project from anywhere but the zip the session shipped
    (addPyFile), running another Python than the venv's, or all tasks landing on one worker."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import json, sys\n"
        "from spark_jobs.session import build_session\n"
        "from spark_jobs.settings import SparkSettings\n"
        # Wait for both executors before the first job (else a late second executor gets no task):
        # standalone mode counts expected cores only with spark.cores.max.
        "conf = {'spark.cores.max': '2', 'spark.scheduler.minRegisteredResourcesRatio': '1.0',\n"
        "        'spark.scheduler.maxRegisteredResourcesWaitingTime': '120s'}\n"
        "spark = build_session(SparkSettings(master=sys.argv[1], progress=False, conf=conf))\n"
        "def where(_):\n"
        "    import os, sys, spark_jobs, schemas.records\n"
        "    yield [spark_jobs.__file__, schemas.records.__file__, sys.executable, os.getcwd(),\n"
        "           os.environ.get('PYTHONPATH', '')]\n"
        "rows = spark.sparkContext.parallelize(range(4), 4).mapPartitions(where).collect()\n"
        "print(json.dumps(rows))\n"
        "spark.stop()\n")
    proc = subprocess.run([sys.executable, str(probe), spark_cluster.master_url()], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == 4
    for jobs_file, records_file, python, cwd, pythonpath in rows:
        assert ".zip/spark_jobs/" in jobs_file and ".zip/schemas/" in records_file, (jobs_file, records_file)
        assert python == sys.executable
        assert not Path(cwd).is_relative_to(REPO) and str(REPO) not in pythonpath.split(":")  # pyspark's own zips only
    workers = {Path(cwd).parts[-4] for *_, cwd, _ in rows}  # <state>/spark/worker-<n>/work/<app>/<executor>
    assert workers == {"worker-1", "worker-2"}


def test_finetune_on_cluster_matches_local(planted_run, spark_cluster, tmp_path):
    """Catches a job whose outputs depend on where it runs (partitioning, executor order, time zone
    of other JVMs): JSONL and card byte for byte, Parquet rows equal, versus the local run."""
    settings, local = planted_run
    assert settings.model_fields_set <= {"source", "archive_dir", "out", "eval_files", "validation_fraction"}, \
        "planted_run has new settings: pass them to the cluster run too"
    out = tmp_path / "cluster-ft"
    args = ["job", "finetune-dataset", "--master", spark_cluster.master_url(), "--out", str(out),
            "--source", settings.source, "--archive-dir", str(settings.archive_dir),
            "--validation-fraction", str(settings.validation_fraction), "--shuffle-partitions", "2", "--quiet"]
    for eval_file in settings.eval_files:
        args += ["--eval-file", str(eval_file)]
    apps_before = spark_cluster.status().completed_apps
    _chatpipe(*args)
    assert spark_cluster.status().completed_apps == apps_before + 1, "the job did not run on the cluster"
    local_jsonl, cluster_jsonl = _files(local.out, "*.jsonl"), _files(out, "*.jsonl")
    assert set(local_jsonl) == {"sft/train.jsonl", "sft/validation.jsonl", "preference/train.jsonl",
                                "preference/validation.jsonl"}
    assert cluster_jsonl == local_jsonl
    assert _files(out, "dataset_card.*") == _files(local.out, "dataset_card.*")
    for table in ("sft", "preference", "dropped"):
        a = pd.read_parquet(local.out / "parquet" / table)
        b = pd.read_parquet(out / "parquet" / table)
        assert len(a) > 0
        pd.testing.assert_frame_equal(a.reset_index(drop=True), b.reset_index(drop=True))


def test_usage_report_submitted_to_cluster_matches_local(spark, planted_run, spark_cluster, tmp_path):
    """Catches the documented `chatpipe spark submit` form failing on a cluster (connector jars or
    code not shipped, spark-submit's --master ignored) or giving other figures than local mode."""
    from spark_jobs.settings import UsageReportSettings
    from spark_jobs.usage_report import run
    from transport.settings import KafkaSettings

    archive = planted_run[0].archive_dir
    local = run(spark, UsageReportSettings(source="archive", archive_dir=archive, out=tmp_path / "local"),
                KafkaSettings())
    out = tmp_path / "cluster"
    apps_before = spark_cluster.status().completed_apps
    proc = _chatpipe("spark", "submit", "usage-report", "--master", spark_cluster.master_url(), "--",
                     "--out", str(out), "--source", "archive", "--archive-dir", str(archive), "--shuffle-partitions", "2", "--quiet")
    assert f"wrote {out}" in proc.stdout
    for table in ("usage.parquet", "tenants.parquet", "dlq.parquet"):
        a, b = pd.read_parquet(local / table), pd.read_parquet(out / table)
        assert len(a) > 0
        pd.testing.assert_frame_equal(a, b)
    assert (out / "usage_report.md").read_text() == (local / "usage_report.md").read_text()
    status = spark_cluster.status()
    assert (status.apps, status.completed_apps) == ([], apps_before + 1), "the job did not run (and end) on the cluster"
