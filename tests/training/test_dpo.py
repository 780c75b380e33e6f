"""`chatpipe train lora --mode dpo` end to end: liked and disliked answers to the same questions (a regenerated
answer) go through the archive and the dataset job into preference pairs; two DDP processes train on them
with DPO's loss; the eval loss starts at log 2 (the adapter is the identity) and falls: the adapter prefers
the liked answers of held-out pairs.

Real parts: the archive, the dataset job (Spark local), the CLI under TorchDistributor (torchrun, gloo), peft,
the default model.
"""

from __future__ import annotations

import json
import math

import pytest

from chatpipe.testing.planted_facts import facts, planted_preferences
from tests.training.conftest import TRAINING_TIMEOUT_S, dataset_of, run_cli

pytestmark = [pytest.mark.model, pytest.mark.spark, pytest.mark.timeout(TRAINING_TIMEOUT_S)]

STEPS = 8


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("preferences")
    turns, feedback = planted_preferences(facts(4), [("acme", "ada"), ("acme", "bob")], 1_767_225_600_000, wordings=3)
    return dataset_of(root, turns, feedback, 0.25)


def test_dpo_on_the_pipelines_preference_pairs_prefers_the_liked_answers(pairs, tmp_path):
    """Catches a DPO loss on the wrong side, a reference that moves with the policy (no adapter switched off),
    pairs read as SFT lines, or gradients not all-reduced."""
    lines = {split: sum(1 for _ in open(pairs / "preference" / f"{split}.jsonl")) for split in ("train", "validation")}
    assert lines["train"] >= 4 and lines["validation"] >= 1, lines
    done = run_cli("train", "lora", "--mode", "dpo", "--dataset", str(pairs), "--no-publish", "--processes", "2",
                   "--max-steps", str(STEPS), "--batch-size", "2", "--lr", "1e-3", "--dpo-beta", "0.5",
                   "--runs-dir", str(tmp_path), "--run-name", "dpo", "--no-progress", "--seed", "5")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    metrics = json.loads((tmp_path / "dpo" / "metrics.json").read_text())
    assert metrics["processes"] == 2 and metrics["steps"] == STEPS
    assert metrics["eval_loss_before"] == pytest.approx(math.log(2), abs=1e-4)
    assert metrics["eval_loss"] < 0.8 * math.log(2), metrics
    print(f"DPO eval loss on held-out pairs: before {metrics['eval_loss_before']:.4f}, after {metrics['eval_loss']:.4f}")
