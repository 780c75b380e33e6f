"""SFT examples from the dataset job's chat JSONL: token ids through the model's chat template
(``formats.chat_tokens``, the same ids the worker builds when it serves), labels on the answer only.

Each line is one example, ``{"messages": [...]}``, whose **last** message is the assistant's answer the
dataset job selected (liked, edited, kept by its filters); the earlier messages are its history. The loss
covers that last answer only: an earlier answer of the history has an example of its own when the job
kept it, and may have been dropped on purpose (a disliked answer stays in the history of the next turn).

Process r of N owns the lines r, r+N, r+2N... (``read_shard``): it parses, tokenizes and trains on those
only, so no process holds the whole dataset. Each epoch shuffles a shard with the run's seed and the
epoch; a shard one example short repeats one (as ``DistributedSampler`` pads), so every process takes
the same number of steps, which DDP's collective all-reduce needs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from formats.chat_tokens import encode_chat
from schemas.errors import ChatpipeError

IGNORE = -100  # the label torch's cross-entropy skips


class DatasetError(ChatpipeError):
    """The dataset folder or a line of it is not what the dataset job writes."""


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    labels: list[int]  # IGNORE on the prompt, the ids on the answer
    truncated: bool  # history cut to fit max_seq_len

    @property
    def answer_tokens(self) -> int:
        return sum(1 for label in self.labels if label != IGNORE)


def split_path(dataset: Path, split: str) -> Path:
    path = Path(dataset) / "sft" / f"{split}.jsonl"
    if not path.is_file():
        raise DatasetError(f"no {path}: expected the output folder of `chatpipe job finetune-dataset`")
    return path


def count_examples(path: Path) -> int:
    with open(path, encoding="utf-8") as lines:
        return sum(1 for line in lines if line.strip())


def shard_lines(path: Path, rank: int = 0, processes: int = 1,
                selected: Sequence[int] | None = None) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON) of this process's lines: every ``processes``-th non-empty line from ``rank``;
    with ``selected``, of the example numbers a run trains on, every ``processes``-th. DatasetError for a
    line that is not JSON, or a file without examples."""
    example = -1
    position = {n: i for i, n in enumerate(selected)} if selected is not None else None
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            example += 1
            place = example if position is None else position.get(example)
            if place is None or place % processes != rank:
                continue
            try:
                yield number, json.loads(line)
            except ValueError as exc:
                raise DatasetError(f"{path}:{number}: not a chat JSONL line ({exc})") from exc
    if example < 0:
        raise DatasetError(f"{path} has no examples")


def checked_messages(messages: Any, where: str) -> list[dict[str, str]]:
    """The messages of a line, checked: a list of roles (system, user, assistant) with text contents."""
    if not messages or not isinstance(messages, list):
        raise DatasetError(f"{where}: no messages")
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant") \
                or not isinstance(message.get("content"), str):
            raise DatasetError(f"{where}: a message needs a role (system, user, assistant) and text content")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def read_shard(path: Path, rank: int = 0, processes: int = 1,
               selected: Sequence[int] | None = None) -> list[list[dict[str, str]]]:
    """The messages of this process's lines (``shard_lines``), checked: roles, text contents, the last one
    the assistant's."""
    conversations = []
    for number, doc in shard_lines(path, rank, processes, selected):
        messages = doc.get("messages") if isinstance(doc, dict) else None
        if not isinstance(messages, list) or not messages:
            raise DatasetError(f"{path}:{number}: not a chat JSONL line (no \"messages\")")
        if not isinstance(messages[-1], dict) or messages[-1].get("role") != "assistant":
            raise DatasetError(f"{path}:{number}: the last message must be the assistant's answer")
        conversations.append(checked_messages(messages, f"{path}:{number}"))
    return conversations


def tokenize(tokenizer: Any, messages: Sequence[dict[str, str]], max_seq_len: int) -> Example:
    """The example's ids, with labels on the last (assistant) message and its end-of-turn markup."""
    prompt = encode_chat(tokenizer, messages[:-1], add_generation_prompt=True)
    full = encode_chat(tokenizer, messages, add_generation_prompt=False)
    if full[:len(prompt)] != prompt:  # a template that renders a history differently once answered
        raise DatasetError("the chat template does not render the prompt as a prefix of the answered "
                           "conversation; answer tokens cannot be told from the prompt's")
    labels = [IGNORE] * len(prompt) + full[len(prompt):]
    truncated = len(full) > max_seq_len
    if truncated:  # keep the answer (and as much of the most recent history as fits)
        full, labels = full[-max_seq_len:], labels[-max_seq_len:]
    return Example(full, labels, truncated)


class ShardedExamples:
    """One process's shard of a split, tokenized lazily (an example is tokenized when first used); ``make``
    tokenizes one raw line's content (default: an SFT conversation, ``tokenize``)."""

    def __init__(self, conversations: list, tokenizer: Any, max_seq_len: int, make: Any = None):
        self.conversations, self.tokenizer, self.max_seq_len = conversations, tokenizer, max_seq_len
        self.make = make or tokenize
        self._cache: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.conversations)

    def __getitem__(self, index: int):
        if index not in self._cache:
            self._cache[index] = self.make(self.tokenizer, self.conversations[index], self.max_seq_len)
        return self._cache[index]


def collate(examples: Sequence[Example], pad_id: int) -> dict[str, Any]:
    """Right-padded tensors: input_ids, attention_mask, labels (IGNORE on padding)."""
    import torch

    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        ids[row, :n] = torch.tensor(example.input_ids)
        labels[row, :n] = torch.tensor(example.labels)
        mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def shard_size(total: int, processes: int) -> int:
    """Examples per process per epoch: the largest shard's size (a smaller one is padded to it)."""
    return -(-total // processes)


def epoch_order(shard_len: int, padded_len: int, seed: int, epoch: int) -> list[int]:
    """This epoch's order of a shard's examples, padded to ``padded_len`` by repeating from its start."""
    import torch

    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(shard_len, generator=generator).tolist()
    return (order * (padded_len // max(shard_len, 1) + 1))[:padded_len]


def batches(indices: Sequence[int], batch_size: int) -> Iterator[list[int]]:
    for start in range(0, len(indices), batch_size):
        yield list(indices[start:start + batch_size])
