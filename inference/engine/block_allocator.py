"""Book-keeping of the paged KV cache: which fixed-size blocks of token slots belong to which request.

Pure Python, no tensors: the scheduler uses it to decide admission, the engine turns a request's
block table into slot indices of ``kv_cache.PagedKVCache``. The budget is counted in tokens and
rounded up to whole blocks.

Deliberately simple: a request reserves its worst case (prompt + max_new_tokens) at admission, so a
running request can never run out of cache and nothing has to be preempted or swapped. The price is
lower concurrency when callers ask for far more ``max_new_tokens`` than they use; lazy allocation
with preemption (as vLLM does) is the upgrade path. No prefix sharing between requests either.
"""

from __future__ import annotations


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Low block ids first: keeps the cache's hot region compact.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_tokens(self) -> int:
        """Reserved token slots (whole blocks)."""
        return (self.num_blocks - len(self._free)) * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.num_blocks

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= len(self._free)

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds blocks")
        n = self.blocks_for(num_tokens)
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks, {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(n)]
        self._tables[request_id] = blocks
        return blocks

    def free(self, request_id: str) -> None:
        blocks = self._tables.pop(request_id, None)
        if blocks:
            self._free.extend(reversed(blocks))

    def block_table(self, request_id: str) -> list[int]:
        return self._tables[request_id]

    def holds(self, request_id: str) -> bool:
        return request_id in self._tables
