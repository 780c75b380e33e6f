"""Paged KV cache storage and the index tensors that address it.

Storage is one flat pool of token slots per layer, ``[num_blocks * block_size, kv_heads, head_dim]``
for K and for V. A request's tokens live in the blocks ``block_allocator.BlockAllocator`` gave it;
token position ``p`` of a request sits in slot ``table[p // block_size] * block_size + p % block_size``.

Why paged and not one fixed-length slot per request: the KV budget is then real memory counted in
tokens, and short requests do not pay for ``max_seq_len``. The cost is a gather of each running
request's context per layer (``pool[slots]``); with a 135M model on CPU it is a few percent of a
step. Not done: prefix sharing, swapping to host memory, a fused paged-attention kernel.
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
        shape = (num_layers, self.num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, slots, kvH, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, slots, kvH, D]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots [T] long; k, v [T, kvH, D]."""
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slots [..., K] long -> k, v [..., K, kvH, D] (a copy: a gather from the pool)."""
        return self.k[layer][slots], self.v[layer][slots]


def slots_for_positions(block_table: list[int], positions: range, block_size: int) -> list[int]:
    """Cache slots of a request's token positions (plain ints; used for the tokens written this step)."""
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


def context_slots(block_tables: list[list[int]], context_len: int, block_size: int, device: torch.device) -> torch.Tensor:
    """Slots of positions ``0 .. context_len-1`` of each request -> [B, context_len] long.

    Rows shorter than ``context_len`` are padded with block 0 (real memory, masked out later).
    """
    nblocks = -(-context_len // block_size)
    table = torch.zeros(len(block_tables), nblocks, dtype=torch.long)
    for i, bt in enumerate(block_tables):
        row = bt[:nblocks]
        table[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    offsets = torch.arange(block_size, dtype=torch.long)
    slots = (table[:, :, None] * block_size + offsets).reshape(len(block_tables), -1)[:, :context_len]
    return slots.to(device, non_blocking=True)
