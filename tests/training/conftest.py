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


#: Training and the dataset job are batch work: in the suite they run at this CPU priority (nice), so the
#: stack tests beside them on the 2-core CI machine keep their CPU. At normal priority two DDP processes
#: took both cores for minutes, and the inference worker of the pipeline tests beside them measured a rate so
#: low that admission refused requests with 400-500 s estimated waits (429s in tests/gateway, a fresh-clone run).
BATCH_NICE = 10
#: pytest-timeout's limit of a test here (the Makefile's is 900 s), fixtures included: at the batch priority on a
#: loaded CI machine a dataset job and a training run took 725 s as the first test's setup (one fresh-clone run).
TRAINING_TIMEOUT_S = 2400


def run_cli(*args: str, timeout: float = 1800, env: dict | None = None):
    """``chatpipe ARGS`` in a subprocess at the batch priority; the CompletedProcess."""
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "chatpipe.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, preexec_fn=lambda: os.nice(BATCH_NICE))


def dataset_of(root, turns, feedback, validation_fraction: float):
    """``turns`` and ``feedback`` written as the archive under ``root`` and made a dataset by the dataset job
    (Spark local, at the batch priority): its folder."""
    from chatpipe.testing.planted_facts import write_planted_archive

    write_planted_archive(root / "archive", turns, feedback)
    done = run_cli("job", "finetune-dataset", "--source", "archive", "--archive-dir", str(root / "archive"),
                   "--since", "2026-01-01T00:00:00", "--until", "2026-01-02T00:00:00", "--out", str(root / "ds"),
                   "--validation-fraction", str(validation_fraction), "--quiet")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return root / "ds"
