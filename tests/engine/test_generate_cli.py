"""`chatpipe generate` tried as a new user would, on the real default model: each mistake ends in one
line that says what to do (no traceback), and CHATPIPE_* variables are not overridden by flag
defaults."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from chatpipe.cli import app
from inference.engine.text import encode_prompt

pytestmark = pytest.mark.model


def run_cli(*args: str, env: dict[str, str] | None = None):
    result = CliRunner().invoke(app, ["generate", *args], env=env)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def one_error_line(result) -> str:
    """The command failed with exactly one line on stderr, an 'error:' line."""
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


def test_prompt_longer_than_the_context_says_its_size_and_the_limit(default_model):
    """Guards against `RuntimeError: request refused: too_large` with a traceback and no numbers."""
    prompt = "tell me more about streams " * 500
    n_prompt = len(encode_prompt(default_model[1], prompt))
    line = one_error_line(run_cli(prompt, "-n", "8"))
    assert f"{n_prompt} prompt tokens" in line and "2048" in line and "--max-tokens" in line


def test_kv_cache_tokens_falls_through_to_the_environment(default_model):
    """Guards against the flag's default (4096) always overriding CHATPIPE_KV_CACHE_TOKENS: with a
    64-token cache from the environment, a 100-token answer cannot fit and the refusal says 64."""
    line = one_error_line(run_cli("Hi", "-n", "100", env={"CHATPIPE_KV_CACHE_TOKENS": "64"}))
    assert "64-token" in line


def test_kv_cache_tokens_flag_still_wins_over_the_environment(default_model):
    """Guards against the fix going the other way: a flag given overrides the variable."""
    line = one_error_line(run_cli("Hi", "-n", "100", "--kv-cache-tokens", "80", env={"CHATPIPE_KV_CACHE_TOKENS": "64"}))
    assert "80-token" in line


def test_empty_raw_prompt_is_one_line(default_model):
    """Guards against `ValueError: the prompt has no tokens` with a traceback."""
    line = one_error_line(run_cli("--raw", ""))
    assert "empty" in line


def test_unknown_device_is_one_line_naming_the_choices(default_model):
    """Guards against `--device tpu` ending in torch's traceback."""
    line = one_error_line(run_cli("Hi", "--device", "tpu"))
    assert "tpu" in line and "cpu" in line and "cuda" in line


def test_missing_gpu_is_one_line_saying_to_use_the_cpu(default_model):
    """Guards against `--device cuda` on a machine without that GPU ending in a traceback. Where a
    GPU exists, the first index past the last one stands for the missing GPU."""
    device = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
    line = one_error_line(run_cli("Hi", "--device", device))
    assert device in line and "--device cpu" in line


def test_installed_command_prints_no_traceback_for_a_too_long_prompt(default_model):
    """Guards against the console script (chatpipe.cli:main) printing a traceback for a refusal
    that the in-process runner would hide."""
    proc = subprocess.run(
        [sys.executable, "-m", "chatpipe.cli", "generate", "stream " * 3000, "-n", "4"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert [ln for ln in proc.stderr.splitlines() if ln.strip()][-1].startswith("error: ")
