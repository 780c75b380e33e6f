"""DPO's loss and its data, without a model: the formula of the paper, the pairs as the dataset job writes them."""

from __future__ import annotations

import json
import math

import pytest
import torch

from training.preference_data import Pair, read_pair_shard
from training.sft_data import DatasetError
from training.tasks import dpo_loss


def test_the_loss_is_the_papers_formula():
    """Catches chosen and rejected swapped, the reference left out, or beta applied to one side only."""
    policy = torch.tensor([-10.0, -4.0, -12.0, -3.0])  # two chosen rows, then two rejected
    reference = torch.tensor([-11.0, -5.0, -11.0, -2.0])
    beta = 0.5
    expected = [-math.log(1 / (1 + math.exp(-beta * ((-10 + 11) - (-12 + 11))))),
                -math.log(1 / (1 + math.exp(-beta * ((-4 + 5) - (-3 + 2)))))]
    assert dpo_loss(policy, reference, 2, beta).tolist() == pytest.approx(expected)


def test_an_adapter_that_has_learned_nothing_scores_log_2():
    """At the start the policy is the reference (LoRA's B is 0): every pair's loss is log 2, whatever the data."""
    same = torch.tensor([-7.5, -3.25, -9.0, -1.0])
    assert dpo_loss(same, same.clone(), 2, 0.1).tolist() == pytest.approx([math.log(2)] * 2)


def _line(prompt="Capital of Veloria?", chosen="Quennick.", rejected="Pelmora."):
    return json.dumps({"input": {"messages": [{"role": "user", "content": prompt}]},
                       "preferred_output": [{"role": "assistant", "content": chosen}],
                       "non_preferred_output": [{"role": "assistant", "content": rejected}]}) + "\n"


def test_pairs_are_read_in_shards(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(_line(prompt=f"q{i}") for i in range(5)))
    assert [p.prompt[-1]["content"] for p in read_pair_shard(path, 1, 2)] == ["q1", "q3"]
    assert read_pair_shard(path, 0, 1, [4])[0] == Pair([{"role": "user", "content": "q4"}], "Quennick.", "Pelmora.")


@pytest.mark.parametrize("line, error", [
    ('{"messages": []}\n', "not a preference line"),
    (_line().replace('"role": "assistant", "content": "Pelmora."', '"role": "user", "content": "Pelmora."'),
     "an output must be one assistant message"),
    (_line().replace('"role": "user", "content": "Capital', '"role": "assistant", "content": "Capital'),
     "the input's last message must be the user's"),
])
def test_a_bad_pair_is_named_with_its_line(tmp_path, line, error):
    path = tmp_path / "train.jsonl"
    path.write_text(_line() + line)
    with pytest.raises(DatasetError, match=f"{path}:2: {error}"):
        read_pair_shard(path)
