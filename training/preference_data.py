"""DPO pairs from the dataset job's preference JSONL (OpenAI's preference format), tokenized like SFT examples.

Each line of ``preference/<split>.jsonl`` is ``{"input": {"messages": [...]}, "preferred_output": [assistant
message], "non_preferred_output": [assistant message]}``: a prompt with its history and two answers to it,
the one its user liked (or wrote, editing) and the one they did not. A pair becomes two ``Example``s with
the same prompt ids and labels on each answer (``sft_data.tokenize``), so the loss reads the log-probability
of each whole answer. Lines are sharded across processes as the SFT lines are (``sft_data.shard_lines``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from training.sft_data import DatasetError, Example, checked_messages, shard_lines, tokenize


@dataclass(frozen=True)
class Pair:
    prompt: list[dict[str, str]]
    chosen: str
    rejected: str


def pair_split_path(dataset: Path, split: str) -> Path:
    path = Path(dataset) / "preference" / f"{split}.jsonl"
    if not path.is_file():
        raise DatasetError(f"no {path}: expected the output folder of `chatpipe job finetune-dataset`")
    return path


def _answer(side: Any, where: str) -> str:
    messages = checked_messages(side, where)
    if len(messages) != 1 or messages[0]["role"] != "assistant":
        raise DatasetError(f"{where}: an output must be one assistant message")
    return messages[0]["content"]


def read_pair_shard(path: Path, rank: int = 0, processes: int = 1,
                    selected: Sequence[int] | None = None) -> list[Pair]:
    pairs = []
    for number, doc in shard_lines(path, rank, processes, selected):
        where = f"{path}:{number}"
        if not isinstance(doc, dict) or not isinstance(doc.get("input"), dict):
            raise DatasetError(f"{where}: not a preference line (input, preferred_output, non_preferred_output)")
        prompt = checked_messages(doc["input"].get("messages"), where)
        if prompt[-1]["role"] != "user":
            raise DatasetError(f"{where}: the input's last message must be the user's")
        pairs.append(Pair(prompt, _answer(doc.get("preferred_output"), where),
                          _answer(doc.get("non_preferred_output"), where)))
    return pairs


def tokenize_pair(tokenizer: Any, pair: Pair, max_seq_len: int) -> tuple[Example, Example]:
    """(chosen, rejected) examples: the prompt, then each answer with the labels on it."""
    return (tokenize(tokenizer, [*pair.prompt, {"role": "assistant", "content": pair.chosen}], max_seq_len),
            tokenize(tokenizer, [*pair.prompt, {"role": "assistant", "content": pair.rejected}], max_seq_len))
