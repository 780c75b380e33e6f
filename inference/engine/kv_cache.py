"""Paged KV cache storage and the index tensors that address it.

Storage is one pool of token slots per layer and KV head, ``[kv_heads, num_blocks * block_size, head_dim]``
for K and for V. Head-major, so a gather of blocks comes out as ``[kv_heads, B, K, head_dim]``,
already contiguous for attention: SDPA on CPU ran about 2x slower on the strided view a
slot-major layout gives (1.17 ms vs 0.65 ms per layer for 16 requests x 304 tokens). A request's
tokens live in the blocks ``block_allocator.BlockAllocator`` gave it (full blocks may be shared
with other requests through the prefix cache; they are only read); token position ``p`` of a
request sits in slot ``table[p // block_size] * block_size + p % block_size``.

Why paged and not one fixed-length slot per request: the KV budget is then real memory counted in
tokens, and short requests do not pay for ``max_seq_len``. The cost is a gather of each running
request's context blocks per layer (``read_blocks``): indexing every token slot took 13% of the
CPU time of a batch-16 SmolLM2 run (torch profiler), whole-block gathers cut that about 3x.
``DeviceBlockTables`` keeps the block tables on the device so building a step's indices is host
work per request, not per token of context. Decode rows skip the gather where a paged kernel
reads the pool in place (``kernels/``: C on CPU, Triton on CUDA). Not done: swapping to host memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockGather:
    """Which rows of a layer's pool hold ``batch`` requests' first ``blocks`` context blocks, head-major
    (``PagedKVCache.block_gather``)."""

    rows: torch.Tensor  # [kvH * batch * blocks] long, into the pool's [kvH * num_blocks, block_size * D] view
    batch: int
    blocks: int


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        shape = (num_layers, num_kv_heads, self.num_slots, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, kvH, slots, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, kvH, slots, D]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots [T] long; k, v [T, kvH, D]."""
        self.k[layer].index_copy_(1, slots, k.transpose(0, 1))
        self.v[layer].index_copy_(1, slots, v.transpose(0, 1))

    def block_gather(self, blocks: torch.Tensor) -> BlockGather:
        """The rows ``read_blocks`` copies for the requests' blocks ``[B, N]`` (block ids): made once per
        step, used by every layer."""
        b, n = blocks.shape
        heads, slots, _ = self.k.shape[1:]
        head_base = torch.arange(heads, device=blocks.device)[:, None] * (slots // self.block_size)
        return BlockGather((head_base + blocks.reshape(1, -1)).reshape(-1), b, n)

    def read_blocks(self, layer: int, gather: BlockGather) -> tuple[torch.Tensor, torch.Tensor]:
        """The gathered blocks -> k, v [kvH, B, N * block_size, D], contiguous.

        Gathers whole blocks as rows of a ``[kvH * num_blocks, block_size * D]`` view: one
        ``index_select`` along dim 0 of a contiguous matrix, which torch runs as one memcpy per row.
        (Along dim 1 of ``[kvH, num_blocks, block_size * D]`` it ran one strided copy op per block:
        86 of a 201 ms SmolLM2 decode step at batch 16 x 540 tokens; indexing every token slot, before
        that, was slower still.)
        """
        out = []
        for pool in (self.k[layer], self.v[layer]):
            heads, _, dim = pool.shape
            rows = pool.view(-1, self.block_size * dim)  # [kvH * blocks, bs*D]
            picked = torch.index_select(rows, 0, gather.rows)
            out.append(picked.view(heads, gather.batch, gather.blocks * self.block_size, dim))
        return out[0], out[1]


def slots_for_positions(block_table: list[int], positions: range, block_size: int) -> list[int]:
    """Cache slots of a request's token positions (plain ints; used for the tokens written this step)."""
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


class DeviceBlockTables:
    """Each running request's block table mirrored on the device, so that building a step's
    attention indices is O(requests) host work, not O(context): a row is written only when the
    request gets new blocks (every ``block_size`` tokens when decoding), and the step takes views
    of the rows. ``forget`` when the request finishes or is preempted (its table is rebuilt)."""

    def __init__(self, max_blocks_per_request: int, device: torch.device) -> None:
        self.max_blocks = max_blocks_per_request
        self.device = device
        self._rows: dict[str, tuple[torch.Tensor, int]] = {}

    def row(self, request_id: str, table: list[int]) -> torch.Tensor:
        """The request's device row [max_blocks] long, updated with the blocks appended since."""
        row, n = self._rows.get(request_id, (None, 0))
        if row is None:
            row = torch.zeros(self.max_blocks, dtype=torch.long, device=self.device)
        if len(table) > n:
            row[n : len(table)] = torch.tensor(table[n:], dtype=torch.long).to(self.device, non_blocking=True)
            n = len(table)
        self._rows[request_id] = (row, n)
        return row

    def gather(self, request_ids: list[str], tables: dict[str, list[int]], context_len: int, block_size: int) -> torch.Tensor:
        """Blocks holding positions ``0 .. context_len-1`` of each request -> [B, ceil(context_len/block_size)].
        Shorter requests' rows continue with stale or zero block ids (real memory; the mask hides it)."""
        nblocks = -(-context_len // block_size)
        return torch.stack([self.row(rid, tables[rid])[:nblocks] for rid in request_ids])

    def forget(self, request_id: str) -> None:
        self._rows.pop(request_id, None)
