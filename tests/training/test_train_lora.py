"""`chatpipe train lora` end to end: planted conversations through the dataset job, then two DDP processes
under TorchDistributor learn the planted facts; a process killed mid-run is resumed from the last checkpoint
to the same result as a run never interrupted.

Real parts: the archive, the dataset job (Spark local) and the CLI in subprocesses, pyspark's TorchDistributor
(torchrun, gloo), peft, the default model. The full figure (12 facts) is bench/learn_facts.py's.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from chatpipe.testing.planted_facts import facts, held_out, planted_log, write_held_out_questions
from tests.training.conftest import TRAINING_TIMEOUT_S, dataset_of, run_cli

pytestmark = [pytest.mark.model, pytest.mark.spark, pytest.mark.timeout(TRAINING_TIMEOUT_S)]

STEPS = 15  # 5 epochs of the ~18 training lines at a global batch of 8: the facts are learned
ARGS = ["--no-publish", "--processes", "2", "--max-steps", str(STEPS), "--batch-size", "4", "--lr", "1e-3",
        "--checkpoint-every", "5", "--no-progress", "--seed", "7"]
DIE_AFTER = 8  # process 1 exits after step 8: the run goes on from the checkpoint of step 5
#: The final eval loss of a resumed run against the uninterrupted one: the same data order, initialisation and
#: optimizer state, so only the float sums of gloo's all-reduce could differ.
RESUME_TOLERANCE = 0.01


def _train(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_cli("train", "lora", *args, env=env)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """4 facts asked 6 ways each by three users of one tenant, liked, archived, through the dataset job (a quarter
    of the conversations in its validation split: the eval loss)."""
    root = tmp_path_factory.mktemp("planted")
    turns, feedback = planted_log(facts(4), [("acme", "ada"), ("acme", "bob"), ("acme", "cyd")], 1_767_225_600_000,
                                  wordings=6)
    return dataset_of(root, turns, feedback, 0.25)


@pytest.fixture(scope="module")
def uninterrupted(planted, tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    questions = write_held_out_questions(runs / "held_out.jsonl", facts(4))
    done = _train("--dataset", str(planted), "--runs-dir", str(runs), "--run-name", "whole", *ARGS,
                  "--eval-questions", str(questions))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    print(done.stdout[-600:])
    return runs / "whole"


def test_two_processes_learn_the_planted_facts(uninterrupted):
    """Catches a run that trains nothing (frozen adapter, loss on the wrong tokens, gradients not
    all-reduced) or saves an adapter that does not carry what was learned (the held-out questions are asked of
    the saved adapter by --eval-questions)."""
    metrics = json.loads((uninterrupted / "metrics.json").read_text())
    assert metrics["processes"] == 2 and metrics["steps"] == STEPS
    losses = [h["loss"] for h in metrics["history"]]
    assert losses[-1] < losses[0] / 4, losses
    held = metrics["question_evals"]["held_out"]
    assert held["questions"] == len(held_out(facts(4)))
    assert held["base"] == 0 and held["adapter"] >= 0.5, held


def test_a_killed_process_resumes_to_the_same_loss(planted, uninterrupted, tmp_path):
    """Catches a resume that starts over, skips or repeats data, or loses the optimizer's state."""
    killed = _train("--dataset", str(planted), "--runs-dir", str(tmp_path), "--run-name", "killed", *ARGS,
                    env={"CHATPIPE_TRAIN_DRILL_DIE_RANK": "1", "CHATPIPE_TRAIN_DRILL_DIE_AFTER": str(DIE_AFTER)})
    run = tmp_path / "killed"
    assert killed.returncode != 0 and "--resume" in killed.stderr, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-000005"]
    assert not (run / "metrics.json").exists()
    resumed = _train("--resume", str(run), "--no-progress")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    whole = json.loads((uninterrupted / "metrics.json").read_text())
    again = json.loads((run / "metrics.json").read_text())
    assert again["resumed_from"] == 5 and again["steps"] == STEPS
    assert [h["step"] for h in again["history"]] == list(range(1, STEPS + 1))
    assert abs(again["eval_loss"] - whole["eval_loss"]) <= RESUME_TOLERANCE * whole["eval_loss"], (again, whole)
    print(f"eval loss: uninterrupted {whole['eval_loss']:.5f}, killed after step {DIE_AFTER} and resumed from 5 "
          f"{again['eval_loss']:.5f}")
