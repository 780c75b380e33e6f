"""Sampler tests on hand-made logits (no model)."""

from __future__ import annotations

import pytest
import torch

from inference.engine.request import SamplingParams
from inference.engine.sampling import Sampler


def draw(params: SamplingParams, logits: torch.Tensor, n: int) -> list[int]:
    sampler = Sampler("cpu")
    sampler.add("r", params)
    return [sampler.sample_step(logits[None], ["r"], [params]).token_ids[0] for _ in range(n)]


def test_temperature_zero_is_argmax():
    """Guards against greedy requests being sampled."""
    logits = torch.tensor([[0.1, 3.0, 2.9], [5.0, 0.0, 4.9]])
    sampler = Sampler("cpu")
    assert sampler.sample_step(logits, ["a", "b"], [SamplingParams(), SamplingParams()]).token_ids == [1, 0]


def test_same_seed_same_tokens_different_seed_different_tokens():
    """Guards against sampling that ignores the request's seed (non-reproducible outputs)."""
    logits = torch.zeros(1000)
    p = SamplingParams(temperature=1.0, seed=42)
    assert draw(p, logits, 20) == draw(p, logits, 20)
    assert draw(p, logits, 20) != draw(SamplingParams(temperature=1.0, seed=43), logits, 20)


def test_top_k_keeps_only_the_k_best():
    """Guards against top-k letting lower-ranked tokens through."""
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0, 0.0])
    seen = set(draw(SamplingParams(temperature=5.0, top_k=2, seed=0), logits, 200))
    assert seen == {1, 2}


def test_top_p_keeps_the_smallest_set_reaching_p():
    """Guards against nucleus filtering that cuts one token too many or too few."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    seen = set(draw(SamplingParams(temperature=1.0, top_p=0.75, seed=0), logits, 300))
    assert seen == {0, 1}  # 0.5 < 0.75, 0.5 + 0.3 >= 0.75
    assert draw(SamplingParams(temperature=1.0, top_p=0.01, seed=0), logits, 20) == [0] * 20  # best always kept


def test_sampling_follows_the_distribution():
    """Guards against a temperature applied the wrong way round (or not at all)."""
    logits = torch.tensor([2.0, 0.0])
    hot = draw(SamplingParams(temperature=1.0, seed=1), logits, 2000)
    cold = draw(SamplingParams(temperature=0.25, seed=1), logits, 2000)
    p0 = torch.softmax(logits, 0)[0].item()
    assert abs(hot.count(0) / 2000 - p0) < 0.04
    assert cold.count(0) / 2000 > 0.99


def test_invalid_params_are_refused():
    """Guards against silently accepting nonsense sampling values."""
    for bad in (dict(max_new_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-1)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
