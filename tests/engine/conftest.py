"""Fixtures of the engine tests.

``tiny_model`` is a randomly initialised 2-layer Llama (GQA, float32, CPU) built from a config:
no weights are fetched, and it exercises the same code paths as a real model. ``default_model``
is the real SmolLM2-135M-Instruct, pulled once into the user's model cache (tests marked
``model``).
"""

from __future__ import annotations

import pytest
import torch  # a missing torch must fail the engine tests, not skip them


def make_tiny_model(seed: int = 0, vocab_size: int = 256, max_position_embeddings: int = 512):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def tiny_model():
    return make_tiny_model()


@pytest.fixture
def engine_factory(tiny_model):
    """``engine_factory(**settings) -> Engine`` on the tiny model, CPU float32."""
    from inference.engine.engine import Engine
    from inference.engine.settings import EngineSettings

    def make(model=None, **overrides):
        base = dict(device="cpu", dtype="float32", kv_cache_tokens=2048, kv_block_size=4, max_step_tokens=32, max_batch=4)
        base.update(overrides)
        return Engine(model if model is not None else tiny_model, EngineSettings(**base))

    return make


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos=None) -> list[int]:
    """Hugging Face ``generate`` greedy output for one prompt alone (no padding): the reference."""
    out = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="session")
def default_model():
    """(model, tokenizer) of the default model, float32 on CPU; pulled into the model cache once."""
    from inference.engine.model_store import load_model, pull_default_model
    from inference.engine.settings import EngineSettings

    settings = EngineSettings(device="cpu", dtype="float32", kv_cache_tokens=256)
    pull_default_model(settings)
    return load_model(settings)
