"""`chatpipe train lora` refuses what it cannot train on in one line, before Spark or a process starts."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _train(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "chatpipe.cli", "train", "lora", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd)


@pytest.mark.model
def test_a_folder_without_the_dataset_is_named(tmp_path):
    done = _train("--dataset", str(tmp_path / "nowhere"), cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip() == (f"error: no {tmp_path / 'nowhere' / 'sft' / 'train.jsonl'}: expected the output "
                                   "folder of `chatpipe job finetune-dataset`")
    assert not (tmp_path / ".chatpipe").exists(), "no run folder for a run that cannot start"


def test_resume_needs_an_unfinished_run_folder(tmp_path):
    done = _train("--resume", str(tmp_path), cwd=tmp_path)
    assert done.returncode == 1 and done.stderr.strip() == f"error: {tmp_path} is not a run folder (no settings.json)"
    (tmp_path / "settings.json").write_text('{"publish": false}')
    (tmp_path / "metrics.json").write_text("{}")
    done = _train("--resume", str(tmp_path), cwd=tmp_path)
    assert done.returncode == 1 and "finished already" in done.stderr
    (tmp_path / "settings.json").write_text("{}")  # published by default: finished once published
    (tmp_path / "version.json").write_text('{"key": "acme-lora@1"}')
    done = _train("--resume", str(tmp_path), cwd=tmp_path)
    assert done.returncode == 1 and "finished already" in done.stderr


@pytest.mark.model
def test_an_unreadable_eval_file_is_named_before_a_run_starts(tmp_path):
    """Catches --eval-questions read only after the training it was to measure (minutes lost to a typo)."""
    (tmp_path / "ds" / "sft").mkdir(parents=True)
    line = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
    (tmp_path / "ds" / "sft" / "train.jsonl").write_text(line * 2)
    (tmp_path / "capitals.jsonl").write_text('{"question": "Capital of Veloria?", "expected": "Quennick"}\n{"question": "x"}\n')
    done = _train("--dataset", str(tmp_path / "ds"), "--no-publish", "--runs-dir", str(tmp_path / "runs"),
                  "--eval-questions", str(tmp_path / "capitals.jsonl"), cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip() == f'error: {tmp_path / "capitals.jsonl"}:2: a line is {{"question": "...", "expected": "..."}}'
    assert not (tmp_path / "runs").exists(), "no run folder for a run that cannot start"
