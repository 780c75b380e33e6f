"""`chatpipe train lora --master spark://...` on the project's Spark standalone cluster (master + 2 workers of one
core each): TorchDistributor starts the two DDP processes as barrier tasks on the two executors, they train what
local mode trains, from the code the driver shipped; a process killed on an executor ends the run with the
`--resume` command, and the resume on the cluster reaches the uninterrupted run's losses.

Real parts: the cluster (`chatpipe spark up`), the dataset job over planted conversations, the CLI in
subprocesses, TorchDistributor (barrier tasks, torchrun, gloo), peft, the default model.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from chatpipe.testing.planted_facts import facts, planted_log
from tests.training.conftest import TRAINING_TIMEOUT_S, dataset_of, run_cli

pytestmark = [pytest.mark.model, pytest.mark.spark, pytest.mark.timeout(TRAINING_TIMEOUT_S)]

STEPS = 4
ARGS = ["--no-publish", "--processes", "2", "--max-steps", str(STEPS), "--batch-size", "4", "--lr", "1e-3",
        "--checkpoint-every", "2", "--no-progress", "--seed", "7"]
#: Losses of the same run in two places: the same shards, order, initialisation and gloo all-reduce of 2 processes
#: (measured: equal to the last digit).
SAME = 1e-4
PROCESS_LINE = re.compile(r"process (\d) of 2 for (\S+): pid \d+ on \S+, working folder (\S+), training code from (\S+)")


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    root = tmp_path_factory.mktemp("planted-cluster")
    turns, feedback = planted_log(facts(4), [("acme", "ada"), ("acme", "bob"), ("acme", "cyd")], 1_767_225_600_000,
                                  wordings=6)
    return dataset_of(root, turns, feedback, 0.25)


@pytest.fixture(scope="module")
def on_cluster(spark_cluster, planted, tmp_path_factory):
    """The run on the cluster: (its folder, the CLI's CompletedProcess)."""
    runs = tmp_path_factory.mktemp("cluster-runs")
    done = run_cli("train", "lora", "--dataset", str(planted), "--runs-dir", str(runs), "--run-name", "cluster",
                   "--master", spark_cluster.master_url(), *ARGS)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return runs / "cluster", done


def _losses(run: Path) -> tuple[list[float], float]:
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["processes"] == 2 and metrics["steps"] == STEPS
    return [h["loss"] for h in metrics["history"]], metrics["eval_loss"]


def test_the_processes_run_on_both_executors_from_the_shipped_code(spark_cluster, on_cluster):
    """Catches processes not started on the cluster (local mode in disguise), both on one executor, and training
    processes importing the code installed on the worker machine instead of the zip the driver shipped (the
    torchrun children of a Python worker do not see its sys.path: spark_jobs/shipping.py)."""
    run, done = on_cluster
    lines = {int(rank): (Path(folder), Path(code)) for rank, of_run, folder, code in PROCESS_LINE.findall(done.stdout + done.stderr)
             if of_run == str(run)}
    assert sorted(lines) == [0, 1], done.stdout[-3000:] + done.stderr[-3000:]
    spark_dir = spark_cluster.settings.state_dir / "spark"
    workers = {folder.relative_to(spark_dir).parts[0] for folder, _ in lines.values()}
    assert workers == {"worker-1", "worker-2"}, lines
    for folder, code in lines.values():
        assert code.parent.parent == folder and re.fullmatch(r"chatpipe-[0-9a-f]{16}\.zip", code.parent.name), code
        assert code.name == "training"


def test_the_cluster_trains_what_local_mode_trains(planted, on_cluster, tmp_path):
    """Catches processes that do not rendezvous (each training alone), shards decided by something other than the
    rank, and a cluster run that differs from local mode's on the same data and seed."""
    local = run_cli("train", "lora", "--dataset", str(planted), "--runs-dir", str(tmp_path), "--run-name", "local",
                    *ARGS)
    assert local.returncode == 0, local.stdout[-3000:] + local.stderr[-3000:]
    cluster_steps, cluster_eval = _losses(on_cluster[0])
    local_steps, local_eval = _losses(tmp_path / "local")
    assert cluster_steps == pytest.approx(local_steps, abs=SAME) and cluster_eval == pytest.approx(local_eval, abs=SAME)
    assert cluster_steps[-1] < cluster_steps[0]


def test_a_process_killed_on_an_executor_resumes_on_the_cluster(spark_cluster, planted, on_cluster, tmp_path):
    """Catches a lost process on a cluster leaving a traceback instead of the --resume command (Spark does not
    retry a failed barrier result stage: the run ends), checkpoints the executors' processes did not write in the
    run folder, and a resume on the cluster that does not reach the uninterrupted run's losses."""
    drill = {"spark.executorEnv.CHATPIPE_TRAIN_DRILL_DIE_RANK": "1", "spark.executorEnv.CHATPIPE_TRAIN_DRILL_DIE_AFTER": "3"}
    killed = run_cli("train", "lora", "--dataset", str(planted), "--runs-dir", str(tmp_path), "--run-name", "killed",
                     "--master", spark_cluster.master_url(), *ARGS, env={"CHATPIPE_SPARK_CONF": json.dumps(drill)})
    run = tmp_path / "killed"
    errors = [line for line in killed.stderr.splitlines() if line.startswith("error: ")]
    assert killed.returncode == 1 and len(errors) == 1, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert errors[0].startswith("error: the training processes failed (Job aborted") and \
        errors[0].endswith(f"`chatpipe train lora --resume {run}` goes on from it"), errors
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-000002"]
    resumed = run_cli("train", "lora", "--resume", str(run), "--no-progress")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert json.loads((run / "metrics.json").read_text())["resumed_from"] == 2
    again_steps, again_eval = _losses(run)
    whole_steps, whole_eval = _losses(on_cluster[0])
    assert again_steps == pytest.approx(whole_steps, abs=SAME) and again_eval == pytest.approx(whole_eval, abs=SAME)
