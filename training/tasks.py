"""What a run optimises, by ``--mode``: the data it reads, the loss of a step, the eval loss.

- ``sft``: ``sft/<split>.jsonl``; the mean cross-entropy of the answer tokens (``sft_data``).
- ``dpo``: ``preference/<split>.jsonl``; Direct Preference Optimization (Rafailov et al. 2023):
  ``-log sigmoid(beta * ((log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))))``,
  each log-probability summed over the answer's tokens. The reference is the base model: the same weights
  with the adapter switched off (peft's ``disable_adapter``), so no second model is loaded; at the start the
  adapter is the identity and the loss is exactly log 2 (0.6931) on every pair.

Our own DPO loss, not trl's ``DPOTrainer``: trl brings its own training loop (transformers' ``Trainer``),
and a run here needs this package's loop (its shards, selection, checkpoints and step-exact resume, DDP under
TorchDistributor); the loss itself is the three lines of ``dpo_loss``, checked against the paper's formula
in tests/training/test_dpo.py.

Both score batches the same way: ``collate`` pads, the eval reports a mean per unit (answer token, pair).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from training.preference_data import pair_split_path, read_pair_shard, tokenize_pair
from training.sft_data import IGNORE, collate, read_shard, split_path, tokenize


class SftTask:
    table = "sft"  # the dataset job's Parquet table of the same rows (lineage)

    def path(self, dataset: Path, split: str) -> Path:
        return split_path(dataset, split)

    def read(self, path: Path, rank: int, processes: int, selected: Sequence[int] | None) -> list:
        return read_shard(path, rank, processes, selected)

    def item(self, tokenizer: Any, raw: Any, max_seq_len: int):
        return tokenize(tokenizer, raw, max_seq_len)

    def step_loss(self, trained, model, items: list, pad_id: int) -> tuple[torch.Tensor, int]:
        """The step's loss (with its graph) and the tokens it read."""
        batch = collate(items, pad_id)
        return trained(**batch).loss, int(batch["attention_mask"].sum())

    def eval_sums(self, model, items: list, pad_id: int) -> tuple[float, float]:
        """(loss summed over answer tokens, answer tokens) of a batch, no gradients."""
        batch = collate(items, pad_id)
        n = int((batch["labels"][:, 1:] != IGNORE).sum())
        return (float(model(**batch).loss) * n, n) if n else (0.0, 0)


def sequence_logps(model, batch: dict[str, Any]) -> torch.Tensor:
    """Per row: the log-probability of its labelled tokens (the answer), summed."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    mask = labels != IGNORE
    logps = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (logps * mask).sum(-1)


def dpo_loss(policy: torch.Tensor, reference: torch.Tensor, pairs: int, beta: float) -> torch.Tensor:
    """Per pair: DPO's loss, from the summed log-probabilities of ``pairs`` chosen rows then as many rejected."""
    margin = (policy[:pairs] - reference[:pairs]) - (policy[pairs:] - reference[pairs:])
    return -torch.nn.functional.logsigmoid(beta * margin)


class DpoTask:
    table = "preference"

    def __init__(self, beta: float) -> None:
        self.beta = beta

    def path(self, dataset: Path, split: str) -> Path:
        return pair_split_path(dataset, split)

    def read(self, path: Path, rank: int, processes: int, selected: Sequence[int] | None) -> list:
        return read_pair_shard(path, rank, processes, selected)

    def item(self, tokenizer: Any, raw: Any, max_seq_len: int):
        return tokenize_pair(tokenizer, raw, max_seq_len)

    def _losses(self, scored, model, items: list, pad_id: int) -> torch.Tensor:
        batch = collate([c for c, _ in items] + [r for _, r in items], pad_id)
        policy = sequence_logps(scored, batch)
        with torch.no_grad(), model.disable_adapter():
            reference = sequence_logps(model, batch)
        return dpo_loss(policy, reference, len(items), self.beta), int(batch["attention_mask"].sum())

    def step_loss(self, trained, model, items: list, pad_id: int) -> tuple[torch.Tensor, int]:
        losses, tokens = self._losses(trained, model, items, pad_id)
        return losses.mean(), tokens

    def eval_sums(self, model, items: list, pad_id: int) -> tuple[float, float]:
        """(DPO loss summed over pairs, pairs)."""
        losses, _ = self._losses(model, model, items, pad_id)
        return float(losses.sum()), len(items)


def task_for(mode: str, beta: float):
    return DpoTask(beta) if mode == "dpo" else SftTask()
