"""Paged decode attention that reads K/V in place through the block table.

Why (issue 22): ``ModelRunner._attention``'s decode branch gathers every decode row's context
blocks into a contiguous ``[Hkv, B, K, D]`` copy (``PagedKVCache.read_blocks``) and then runs SDPA
on it. The gather reads the context once and writes it once, and SDPA reads the copy again, and
all rows are padded to the longest context: at batch 32 on an 8B model that moves about 7 GB per
decode step (the issue's estimate), where a kernel that reads each row's own blocks once reads
about 1 GB. This module's
kernel does the latter: flash-decoding style, an online softmax in float32 over tiles of the
row's tokens, loading each tile's K and V rows straight from the pool.

Layout (``kv_cache.py``): one layer's pools ``k_pool``, ``v_pool`` are ``[Hkv, num_slots, D]``,
``num_slots = num_blocks * block_size``; token position ``p`` of a row lives in slot
``block_tables[row, p // block_size] * block_size + p % block_size``. Queries are ``[B, Hq, D]``,
one new token per row (its K/V already stored), with GQA: query head ``h`` reads KV head
``h // G``, ``G = Hq // Hkv`` (the same grouping as the runner's ``view(B, Hkv, G, D)``).

Supported: float32 / bfloat16 / float16 pools, any head_dim (tested 64 and 128), any block size
(tiles of tokens are independent of blocks; tested 3, 4, 8, 16, 32, 128), any context length,
int32 or int64 block tables with at least ``ceil(context_len / block_size)`` columns, strided
q / pools / output (e.g. q as a view of a fused qkv tensor). ``context_lens[row] == 0`` is defined:
that row reads nothing (its block table is not touched) and its output is zeros; a padding row
with context 1 whose table points at a scratch block just attends to that slot.
Not supported / not checked: block ids outside the pool (the kernel does no bounds check:
out-of-range ids read out of bounds, where the tests' torch reference raises), split-KV across
programs (one row with a very long context runs in Hkv programs only; fine at serving batch
sizes, slow for batch 1 x 100k tokens), prefill (multi-token rows: the runner keeps SDPA),
sliding windows, ALiBi, soft-capping.

The kernel needs CUDA, or Triton's interpreter (``TRITON_INTERPRET=1`` set before triton and this
module are first imported; the tests run it in a child process, see
``tests/engine/test_paged_kernel.py``, whose plain-torch reference is the kernel's oracle). On CPU,
and wherever ``HAVE_TRITON`` is False (triton not installed: CPU-only torch builds), the runner
keeps the gather + SDPA decode path.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only torch builds ship without triton: the runner keeps gather + SDPA
    HAVE_TRITON = False


# -- the Triton kernels ---------------------------------------------------------------------------

if HAVE_TRITON:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr,
        stride_qb, stride_qh, stride_qd,
        stride_kh, stride_ks, stride_kd,
        stride_vh, stride_vs, stride_vd,
        stride_btb, stride_btn,
        stride_ob, stride_oh, stride_od,
        qk_scale_log2,  # softmax scale * log2(e): the softmax runs in base 2 (exp2 is the fast one)
        G: tl.constexpr,  # query heads per KV head
        D: tl.constexpr,  # head_dim
        BLOCK_SIZE: tl.constexpr,  # tokens per cache block (any; a constant, so // and % are cheap)
        GP: tl.constexpr,  # G padded to a power of two >= 16 (tl.dot's smallest M)
        DP: tl.constexpr,  # D padded to a power of two
        TILE_N: tl.constexpr,  # tokens per loop iteration, power of two >= 16
        DOT_PRECISION: tl.constexpr,  # "ieee" for float32 pools (exact), "tf32" otherwise (see below)
    ):  # fmt: skip
        # One program per (row, KV head), not per (row, query head): the G query heads that share a
        # KV head are the rows of one [GP, D] tile, so each K/V tile is loaded from memory once for
        # all of them (a per-query-head grid would load it G times and hope for L2 hits), and the
        # two products are tl.dot's, on tensor cores. Padding G (3 or 4 in practice) to 16 costs
        # only idle tensor-core lanes; decode is bound by reading K/V.
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        ctx_len = tl.load(lens_ptr + row).to(tl.int32)

        g = tl.arange(0, GP)
        d = tl.arange(0, DP)
        g_ok = g < G
        d_ok = d < D
        qh = kvh * G + g  # query heads of this KV head, as in the runner's view(B, Hkv, G, D)
        q = tl.load(
            q_ptr + row * stride_qb + qh[:, None] * stride_qh + d[None, :] * stride_qd,
            mask=g_ok[:, None] & d_ok[None, :], other=0.0,
        ).to(tl.float32)  # [GP, DP]

        m = tl.full([GP], float("-inf"), tl.float32)  # running max of the scores (base-2 units)
        l_sum = tl.zeros([GP], tl.float32)  # running sum of exp2(score - m)
        acc = tl.zeros([GP, DP], tl.float32)  # running sum of exp2(score - m) * v

        k_head = k_ptr + kvh.to(tl.int64) * stride_kh
        v_head = v_ptr + kvh.to(tl.int64) * stride_vh
        bt_row = bt_ptr + row.to(tl.int64) * stride_btb
        # Only tiles holding tokens < ctx_len: a row of context 0 runs no iteration and reads
        # nothing, and the masks below keep the last tile's tail (stale slots) out of memory too.
        for start in range(0, ctx_len, TILE_N):
            n = start + tl.arange(0, TILE_N)  # token positions of this tile
            n_ok = n < ctx_len
            # Slot of each token through the block table: any block size, tiles may span blocks.
            blk = tl.load(bt_row + (n // BLOCK_SIZE) * stride_btn, mask=n_ok, other=0).to(tl.int64)
            slot = blk * BLOCK_SIZE + n % BLOCK_SIZE
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_head + slot[:, None] * stride_ks + d[None, :] * stride_kd, mask=kv_mask, other=0.0)
            v = tl.load(v_head + slot[:, None] * stride_vs + d[None, :] * stride_vd, mask=kv_mask, other=0.0)
            # Products in float32 on float32-converted tiles: a bf16/fp16 value is exact in tf32
            # (10 mantissa bits), so "tf32" tensor cores give the exact q.k products; float32 pools
            # take "ieee" so that they match the float32 reference to ~1e-6. (Also: Triton's
            # interpreter multiplies bf16 dot operands as raw uint16 bits; float32 operands avoid it.)
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=DOT_PRECISION)  # [GP, TILE_N]
            s = tl.where(n_ok[None, :], s * qk_scale_log2, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: this tile has >= 1 valid token
            alpha = tl.exp2(m - m_new)  # rescales what was summed under the old max (0 at first)
            p = tl.exp2(s - m_new[:, None])  # masked tokens: exp2(-inf) = 0
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=DOT_PRECISION)
            m = m_new

        # l_sum == 0 only for context 0 (acc is 0 too): those rows return zeros, not 0/0.
        out = acc / tl.where(l_sum > 0.0, l_sum, 1.0)[:, None]
        tl.store(
            out_ptr + row * stride_ob + qh[:, None] * stride_oh + d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :],
        )  # fmt: skip


# -- launchers ------------------------------------------------------------------------------------


def _need_triton() -> None:
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed: use the gather + SDPA decode path (paged_kernel off)")


def check_decode_args(q, k_pool, v_pool, block_tables, context_lens, block_size) -> tuple[int, int, int, int]:
    b, hq, d = q.shape
    hkv, _, dk = k_pool.shape
    if v_pool.shape != k_pool.shape or dk != d:
        raise ValueError(f"k_pool {tuple(k_pool.shape)}, v_pool {tuple(v_pool.shape)} and q {tuple(q.shape)} disagree")
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    if block_size < 1:
        raise ValueError(f"block_size {block_size} < 1")
    if block_tables.dim() != 2 or block_tables.shape[0] != b or context_lens.shape != (b,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} / context_lens {tuple(context_lens.shape)} for {b} rows")
    return b, hq, hkv, d


def decode_output(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The kernels' output: ``out`` when given (it must have q's shape), else a new tensor like q."""
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape:
        raise ValueError(f"out {tuple(out.shape)} is not q's shape {tuple(q.shape)}")
    return out


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
    """q [B, Hq, D]; k_pool, v_pool [Hkv, num_slots, D]; block_tables [B, max_blocks] int32/int64;
    context_lens [B] int (tokens attended, the current one included) -> out [B, Hq, D], q's dtype.

    ``softmax(scale * q k^T) v`` over each row's first ``context_lens[row]`` tokens, read in place
    from the pools. Rows of context 0 return zeros. ``out`` [B, Hq, D] (e.g. a slice of the runner's
    output buffer) saves a copy; it is written and returned. Nothing is synchronised with the host."""
    _need_triton()
    b, hq, hkv, d = check_decode_args(q, k_pool, v_pool, block_tables, context_lens, block_size)
    g = hq // hkv
    out = decode_output(q, out)
    if b == 0:
        return out
    dp = triton.next_power_of_2(d)
    # ~4k elements per K (and V) tile: 32 tokens of head_dim 128, 64 of head_dim 64.
    tile_n = max(16, min(64, 4096 // dp))
    precision = "ieee" if k_pool.dtype == torch.float32 else "tf32"
    _paged_decode_kernel[(b, hkv)](
        q, k_pool, v_pool, block_tables, context_lens, out,
        q.stride(0), q.stride(1), q.stride(2),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        block_tables.stride(0), block_tables.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        scale * math.log2(math.e),
        G=g, D=d, BLOCK_SIZE=block_size, GP=max(16, triton.next_power_of_2(g)), DP=dp,
        TILE_N=tile_n, DOT_PRECISION=precision,
        num_warps=4,
    )  # fmt: skip
    return out

