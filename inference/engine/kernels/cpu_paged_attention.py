"""Paged decode attention on CPU (float32) that reads K/V in place: the C kernel beside this file.

Why hand-written (issue 45): on CPU the runner's decode attention otherwise gathers every decode
row's context blocks into a padded copy (``PagedKVCache.read_blocks``) and runs SDPA on it, which
reads the context twice, writes it once and pads each row to the longest. torch has no CPU
attention over a paged cache (FlexAttention's paged form needs ``torch.compile``, whose start cost
the CPU engine avoids), vLLM's CPU kernels ship only with vLLM's own pinned torch, and Triton does
not compile for CPU. Measured on the 2-core test VM, SmolLM2-135M, 16 decodes of ~540 tokens, per
decode step: gather + SDPA about 90 ms of 190 ms, this kernel (figures in docs/engine.md) a few ms.

How: the C file is compiled once per machine with the system's C compiler (``cc``, or ``$CC``) at
``-O3 -march=native`` into ``~/.cache/chatpipe/kernels`` (keyed by the source, the compiler and the
CPU's flags; about a second), loaded with ctypes (which drops the GIL during the call) and run on
torch's own OpenMP threads (the C file's header says how). Where no compiler is found or the build fails,
``available()`` is False with the reason logged once, and the engine keeps gather + SDPA.

Same contract as the Triton kernel (``paged_attention.paged_decode_attention``, whose layout notes
apply): q [B, Hq, D], pools [Hkv, num_slots, D], block tables [B, >= ceil(len / block_size)],
``context_lens[row] == 0`` gives zeros. float32 only (the CPU engine's dtype); block ids are not
bounds-checked (the runner's tables come from the allocator).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

import torch

from inference.engine.kernels.paged_attention import check_decode_args, decode_output

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_paged_attention.c")
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared"]


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "chatpipe" / "kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def build(compiler: str) -> Path:
    """The kernel's shared library, compiled into the cache unless already there."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu_flags()]).encode())
    target = cache_dir() / f"cpu_paged_attention-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        done = subprocess.run([compiler, *FLAGS, "-o", str(tmp), str(SOURCE), "-lm"],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: workers starting together each build, one file wins
    return target


@functools.cache
def _library() -> ctypes.CDLL | None:
    compiler = shutil.which(os.environ.get("CC") or "cc")
    if compiler is None:
        log.warning("no C compiler (cc or $CC) on PATH: CPU decode attention uses gather + SDPA (slower)")
        return None
    try:
        lib = ctypes.CDLL(str(build(compiler)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("the CPU paged-attention kernel did not build (%s): CPU decode attention uses gather + SDPA", exc)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.paged_decode_f32.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64,
                                     i64, i64, ctypes.c_float, ctypes.c_int]
    lib.paged_decode_f32.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the kernel is built (building it the first time on this machine)."""
    return _library() is not None


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, D]; k_pool, v_pool [Hkv, num_slots, D]; block_tables [B, max_blocks]; context_lens [B]
    -> out [B, Hq, D]: ``softmax(scale * q k^T) v`` over each row's first ``context_lens[row]`` tokens."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU paged-attention kernel is not built on this machine (see the log)")
    b, hq, hkv, d = check_decode_args(q, k_pool, v_pool, block_tables, context_lens, block_size)
    tensors = (q, k_pool, v_pool) if out is None else (q, k_pool, v_pool, out)
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        raise ValueError("the CPU paged-attention kernel takes float32 CPU tensors")
    out = decode_output(q, out)
    if b == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    k_pool, v_pool = k_pool.contiguous(), v_pool.contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    target = out if out.stride(2) == 1 else torch.empty_like(q)
    status = lib.paged_decode_f32(
        q.data_ptr(), q.stride(0), q.stride(1), k_pool.data_ptr(), v_pool.data_ptr(), k_pool.stride(0),
        tables.data_ptr(), tables.stride(0), lens.data_ptr(), target.data_ptr(), target.stride(0), target.stride(1),
        b, hq, hkv, d, block_size, scale, torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise MemoryError("the CPU paged-attention kernel could not allocate its score buffers")
    if target is not out:
        out.copy_(target)
    return out


if __name__ == "__main__":  # `make setup`: build it once up front, so no engine start waits for the compiler
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    library = _library()
    if library is not None:
        print(f"CPU paged-attention kernel: {library._name}")  # the path it was loaded from
    else:
        print("CPU paged-attention kernel: not built (see above); the CPU engine uses gather + SDPA")
