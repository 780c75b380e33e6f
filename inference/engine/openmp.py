"""Give back the OpenMP threads of a thread that will run no more model code.

Why: torch's CPU kernels run on GNU OpenMP (libgomp), which gives every thread that starts a
parallel region its own team of worker threads. The worker loads and packs the model on its main
thread, then steps it on the engine's step thread, so two teams exist. Once libgomp manages more
threads than there are CPUs, it cuts the spin-wait of idle team threads from 300,000 rounds to 100:
the step thread's team then sleeps and is woken at nearly every parallel region. Measured on the
2-core VM, one 2-second round of the worker bench's load: 3,000-4,200 sleeps of the step thread and
8,000-9,300 of its OpenMP worker; every wake-up waits for a CPU (0.02-0.05 s a round for the step
thread with the engine alone, 0.13-0.26 s beside the broker). With the loading thread's team given back
(``omp_pause_resource_all``, OpenMP 5.0), the step thread's team is the only one and spins between
regions as libgomp intends (a few sleeps a round).

A thread that runs a parallel region again later gets a new team; nothing breaks, the spin is cut
again. Other OpenMP runtimes (Intel's, LLVM's) export the same function.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

log = logging.getLogger(__name__)

OPENMP_LIBRARIES = ("libgomp", "libiomp5", "libomp")
OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep what can be kept


def loaded_openmp() -> str | None:
    """The path of the OpenMP runtime loaded in this process (the one torch uses), if any."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux: nothing to look at
        return None
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address, perms, offset, device, inode[, path]
        path = fields[5] if len(fields) == 6 else ""
        if any(Path(path).name.startswith(name + ".") for name in OPENMP_LIBRARIES):
            return path
    return None


def release_thread_pool() -> bool:
    """Give back the calling thread's OpenMP team (call it outside any parallel region, on the
    thread that loaded the model, once another thread runs it). True when the runtime did."""
    path = loaded_openmp()
    if path is None:
        return False
    try:
        pause = ctypes.CDLL(path).omp_pause_resource_all
    except (OSError, AttributeError):  # an OpenMP older than 5.0
        log.debug("OpenMP runtime %s cannot give back its threads", path)
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(OMP_PAUSE_SOFT) == 0
