"""tcmalloc under our engine on CPU: a process that runs it re-executes itself once with tcmalloc
preloaded, as vLLM's CPU build is run (its docs ask for it; infra/vllm_env.py preloads it there).

Why: a CPU step allocates and frees hundreds of activation tensors (each layer's q/k/v, MLP and
attention outputs), and glibc's malloc serves them slower than tcmalloc's per-thread caches.
Measured (bench/engine.py's full workload, SmolLM2-135M float32, 2 threads, 2-core AMD EPYC VM,
one process each): 34.7 s with glibc's malloc, 30.6 s with tcmalloc (a decode step of ~10 rows
54.3 -> 47.0 ms; prefill steps 11.7 -> 10.5 s); Intel OpenMP preloaded as well gave 30.0 s, within
the noise, so it is not.

An allocator has to be in place before the process allocates anything, hence ``LD_PRELOAD`` and a
re-execution (``run_with_tcmalloc``), before torch is imported. The library is Debian's
``libtcmalloc-minimal4`` (apt; `make prerequisites` and `make setup-vllm` install it when run as
root); without it the process runs on glibc's malloc and logs that once. What the re-execution
changes is recorded (infra/process_env.py), so the processes it starts (a broker's JVM, a compiler)
do not inherit the preload. ``CHATPIPE_ALLOCATOR=system`` (EngineSettings.allocator) turns it off.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from infra.process_env import with_changes

log = logging.getLogger(__name__)

TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
            "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")
TRIED = "CHATPIPE_TCMALLOC_TRIED"  # set on re-executing: a preload that did not take does not loop


def tcmalloc() -> str | None:
    """The path of Debian's libtcmalloc_minimal, or None where it is not installed."""
    return next((path for path in TCMALLOC if os.path.isfile(path)), None)


def tcmalloc_from_apt(say) -> None:
    """Install ``libtcmalloc-minimal4`` with apt when it is missing and this runs as root (else nothing)."""
    if tcmalloc() is not None or os.geteuid() != 0 or shutil.which("apt-get") is None:
        return
    say("installing libtcmalloc-minimal4 (apt): the CPU engines run with tcmalloc")
    if subprocess.run(["apt-get", "install", "-y", "-q", "libtcmalloc-minimal4"], capture_output=True).returncode:
        subprocess.run(["apt-get", "update", "-q"], capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-q", "libtcmalloc-minimal4"], capture_output=True)


def tcmalloc_loaded() -> bool:
    """Whether this process runs with a tcmalloc mapped (preloaded, by us or by the caller)."""
    try:
        return "libtcmalloc" in Path("/proc/self/maps").read_text()
    except OSError:  # not Linux: no preloading either
        return False


def run_with_tcmalloc(args: Sequence[str], allocator: str = "tcmalloc") -> None:
    """Replace this process with ``python args...`` with tcmalloc preloaded, unless ``allocator`` is
    ``"system"``, tcmalloc is already loaded, not installed (logged), or a re-execution already tried
    (logged: the preload did not take). Returns only when it does not re-execute. Call it before
    torch (or anything that allocates much) is imported."""
    if allocator == "system" or tcmalloc_loaded():
        return
    path = tcmalloc()
    if path is None:
        log.warning("tcmalloc (libtcmalloc-minimal4) is not installed: the engine runs on glibc's malloc, ~12%% "
                    "slower on CPU (infra/allocator.py; `sudo apt-get install libtcmalloc-minimal4`)")
        return
    if os.environ.get(TRIED):
        log.warning("%s was preloaded but is not loaded: the engine runs on glibc's malloc", path)
        return
    preload = ":".join(filter(None, [path, os.environ.get("LD_PRELOAD", "")]))
    env = with_changes(os.environ, {"LD_PRELOAD": preload, TRIED: "1"})
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *args], env)
