from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def default_model_dir():
    from inference.engine.settings import EngineSettings

    folder = EngineSettings().default_model_dir()
    if not (folder / "config.json").is_file():
        pytest.fail(f"the default model is not in {folder}: `make setup` (chatpipe model pull) puts it there")
    return folder


@pytest.fixture(scope="module")
def default_tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)
