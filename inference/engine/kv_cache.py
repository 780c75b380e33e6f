"""Paged KV cache storage and the index tensors that address it.

Storage is one pool of token slots per layer and KV head, ``[kv_heads, num_blocks * block_size, head_dim]``
for K and for V. Head-major, so a gather of blocks comes out as ``[kv_heads, B, K, head_dim]``,
already contiguous for attention: SDPA on CPU ran about 2x slower on the strided view a
slot-major layout gives (1.17 ms vs 0.65 ms per layer for 16 requests x 304 tokens). A request's tokens live in the blocks ``block_allocator.BlockAllocator`` gave it;
token position ``p`` of a request sits in slot ``table[p // block_size] * block_size + p % block_size``.

Why paged and not one fixed-length slot per request: the KV budget is then real memory counted in
tokens, and short requests do not pay for ``max_seq_len``. The cost is a gather of each running
request's context blocks per layer (``read_blocks``): indexing every token slot took 13% of the
CPU time of a batch-16 SmolLM2 run (torch profiler), whole-block gathers cut that about 3x. Not done: prefix sharing, swapping to host memory, a fused paged-attention kernel.
"""

from __future__ import annotations

import torch


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

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots [T] long; k, v [T, kvH, D]."""
        self.k[layer].index_copy_(1, slots, k.transpose(0, 1))
        self.v[layer].index_copy_(1, slots, v.transpose(0, 1))

    def read_blocks(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """blocks [B, N] long (block ids) -> k, v [kvH, B, N * block_size, D], contiguous.

        Gathers whole blocks as rows of a ``[kvH, num_blocks, block_size * D]`` view: one
        ``index_select`` of contiguous rows, about 3x faster on CPU than indexing every token
        slot (measured: 0.35 ms vs 1.1 ms for 16 requests x 768 tokens of SmolLM2's K).
        """
        b, n = blocks.shape
        flat = blocks.reshape(-1)
        out = []
        for pool in (self.k[layer], self.v[layer]):
            heads, _, dim = pool.shape
            rows = pool.view(heads, -1, self.block_size * dim)  # [kvH, blocks, bs*D]
            out.append(torch.index_select(rows, 1, flat).view(heads, b, n * self.block_size, dim))
        return out[0], out[1]


def slots_for_positions(block_table: list[int], positions: range, block_size: int) -> list[int]:
    """Cache slots of a request's token positions (plain ints; used for the tokens written this step)."""
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


def block_table_tensor(block_tables: list[list[int]], context_len: int, block_size: int, device: torch.device) -> torch.Tensor:
    """Blocks holding positions ``0 .. context_len-1`` of each request -> [B, ceil(context_len/block_size)] long.

    Rows of shorter requests are padded with block 0 (real memory; the attention mask hides it).
    """
    nblocks = -(-context_len // block_size)
    table = torch.zeros(len(block_tables), nblocks, dtype=torch.long)
    for i, bt in enumerate(block_tables):
        row = bt[:nblocks]
        table[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return table.to(device, non_blocking=True)
