"""SFT examples: a process's shard, the epoch order, labels on the answer only, one-line dataset errors."""

from __future__ import annotations

import json

import pytest

from training.sft_data import (IGNORE, DatasetError, Example, collate, epoch_order, read_shard, shard_size,
                               split_path, tokenize)


def _write(path, lines):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((json.dumps(line) if not isinstance(line, str) else line) + "\n" for line in lines))
    return path


def _chat(i):
    return {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}


def test_processes_read_disjoint_shards_that_cover_the_split(tmp_path):
    """Catches a shard that copies the whole split into every process, or loses or repeats a line."""
    path = _write(tmp_path / "sft" / "train.jsonl", [_chat(i) for i in range(7)] + [""])
    shards = [read_shard(path, rank, 3) for rank in range(3)]
    answers = [[m[-1]["content"] for m in shard] for shard in shards]
    assert answers == [["a0", "a3", "a6"], ["a1", "a4"], ["a2", "a5"]]
    assert shard_size(7, 3) == 3


def test_epoch_order_is_seeded_padded_and_differs_by_epoch():
    """Catches an order that is not reproducible on resume, or shards of unequal length (DDP would hang)."""
    first = epoch_order(5, 6, seed=0, epoch=0)
    assert first == epoch_order(5, 6, seed=0, epoch=0)
    assert len(first) == 6 and sorted(set(first)) == [0, 1, 2, 3, 4]
    assert first[5] == first[0]  # the padding repeats from the start
    assert epoch_order(5, 6, seed=0, epoch=1) != first or epoch_order(5, 6, seed=1, epoch=0) != first


def test_collate_pads_with_ignored_labels():
    batch = collate([Example([5, 6, 7], [IGNORE, 6, 7], False), Example([8], [8], False)], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[IGNORE, 6, 7], [8, IGNORE, IGNORE]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


@pytest.mark.parametrize("line, says", [
    ("not json", "not a chat JSONL line"),
    ({"messages": [{"role": "user", "content": "q"}]}, "last message must be the assistant"),
    ({"messages": [{"role": "robot", "content": "q"}, {"role": "assistant", "content": "a"}]}, "needs a role"),
])
def test_a_bad_line_is_named_with_its_number(tmp_path, line, says):
    path = _write(tmp_path / "sft" / "train.jsonl", [_chat(0), line])
    with pytest.raises(DatasetError, match=f"train.jsonl:2: .*{says}"):
        read_shard(path)


def test_a_folder_that_is_no_dataset_says_so(tmp_path):
    with pytest.raises(DatasetError, match="finetune-dataset"):
        split_path(tmp_path, "train")
    _write(tmp_path / "sft" / "train.jsonl", [""])
    with pytest.raises(DatasetError, match="no examples"):
        read_shard(tmp_path / "sft" / "train.jsonl")


@pytest.mark.model
def test_labels_cover_the_last_answer_and_its_end_of_turn(default_tokenizer):
    """Catches a loss on the prompt (the model would learn to write users' questions) or on an earlier
    answer, and a truncation that cuts the answer instead of the oldest history."""
    messages = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Earlier answer."},
                {"role": "user", "content": "What is the capital of Veloria?"},
                {"role": "assistant", "content": "The capital of Veloria is Quennick."}]
    example = tokenize(default_tokenizer, messages, max_seq_len=512)
    answer = default_tokenizer.decode([i for i, label in zip(example.input_ids, example.labels) if label != IGNORE])
    assert answer.startswith("The capital of Veloria is Quennick.") and "Earlier" not in answer
    assert answer.rstrip("\n").endswith("<|im_end|>") and not example.truncated
    short = tokenize(default_tokenizer, messages, max_seq_len=20)
    assert short.truncated and len(short.input_ids) == 20 and short.answer_tokens == example.answer_tokens
