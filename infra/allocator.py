"""tcmalloc and 2 MB pages under our engine on CPU: a process that runs it re-executes itself once with
tcmalloc preloaded, as vLLM's CPU build is run (its docs ask for it; infra/vllm_env.py preloads it
there), and with torch's own switch for transparent huge pages on its large tensors
(``THP_MEM_ALLOC_ENABLE=1``: allocations of 2 MB and more aligned to 2 MB and ``madvise``d).

Why: a CPU step allocates and frees hundreds of activation tensors (each layer's q/k/v, MLP and
attention outputs), which glibc's malloc serves slower than tcmalloc's per-thread caches; and a
decode step streams every weight and each row's KV blocks from memory, ~0.7 GB spread over 4 KB pages
(a TLB miss each), which 2 MB pages cover 512 at a time. Measured on bench/engine.py's full workload
(SmolLM2-135M float32, 2 threads, 2-core AMD EPYC VM, one process each): 34.7 s with glibc's malloc,
30.6 s with tcmalloc (a decode step of ~10 rows 54.3 -> 47.0 ms), 29.7 s with 2 MB pages as well
(30.6 without, same build; ~10-row decode steps 44.2-46.0 vs 48.4-49.2 ms alternating). Intel OpenMP
preloaded as well (vLLM's other preload) gave 30.0 s against 30.6, decode steps within the noise, so
it is not.

An allocator has to be in place before the process allocates anything, hence ``LD_PRELOAD`` and a
re-execution (``run_with_tcmalloc``), before torch is imported. The library is Debian's
``libtcmalloc-minimal4`` (apt; `make prerequisites` and `make setup-vllm` install it when run as
root); without it the process still gets the 2 MB pages and logs once that it runs on glibc's malloc.
What the re-execution changes is recorded (infra/process_env.py), so the processes it starts (a
broker's JVM, a compiler) do not inherit it. ``CHATPIPE_ALLOCATOR=system`` (EngineSettings.allocator)
turns both off; on a kernel whose transparent huge pages are ``never`` the switch does nothing.
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
THP = "THP_MEM_ALLOC_ENABLE"  # torch's switch (c10's CPU allocator): 2 MB-aligned, madvise(MADV_HUGEPAGE)d blocks


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
    """Replace this process with ``python args...`` with tcmalloc preloaded and torch's 2 MB pages on,
    unless ``allocator`` is ``"system"``, both are in place already, or a re-execution already tried
    (logged: the preload did not take). Returns only when it does not re-execute. Call it before torch
    (or anything that allocates much) is imported."""
    if allocator == "system":
        return
    changes = {} if os.environ.get(THP) else {THP: "1"}
    path = tcmalloc()
    if path is not None and not tcmalloc_loaded():
        changes["LD_PRELOAD"] = ":".join(filter(None, [path, os.environ.get("LD_PRELOAD", "")]))
    if changes and not os.environ.get(TRIED):
        env = with_changes(os.environ, {**changes, TRIED: "1"})
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *args], env)
    if path is None:
        log.warning("tcmalloc (libtcmalloc-minimal4) is not installed: the engine runs on glibc's malloc, ~12%% "
                    "slower on CPU (infra/allocator.py; `sudo apt-get install libtcmalloc-minimal4`)")
    elif not tcmalloc_loaded():
        log.warning("%s was preloaded but is not loaded: the engine runs on glibc's malloc", path)
