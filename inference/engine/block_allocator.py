"""Book-keeping of the paged KV cache: which fixed-size blocks of token slots belong to which request,
and which full blocks are cached for reuse by later requests (prefix caching).

Pure Python, no tensors: the scheduler decides with it, the engine turns a request's block table
into slot indices of ``kv_cache.PagedKVCache``. The budget is counted in whole blocks.

A block is in one of three states:
  * in use: held by one or more running requests (``ref_count > 0``; a cached block can be shared);
  * evictable: no request holds it, but it is a *full* block whose contents are registered under
    its hash, so a later request with the same prefix can take it back without recomputing;
  * free: no request holds it and nothing is cached in it.
Allocation takes free blocks first, then evicts the least recently used evictable block.

Prefix hashes form a chain: block ``i``'s hash covers its tokens and block ``i-1``'s hash, so equal
hashes mean equal prefixes up to the end of that block (the K/V of a token depends on everything
before it). BLAKE2b of the token bytes rather than Python's ``hash``: a tenant must not be able to
build a colliding prompt and read another's cache (vLLM switched to SHA-256 for the same reason).

**Per-tenant salt** (issue 19): each tenant's chains start from its own root
(``tenant_root``), so a block computed for one tenant never serves another, and time to first
token tells a tenant nothing about what another one sent (vLLM's ``cache_salt``). Within a
tenant nothing changes. ``salt=False`` (one root for all) is the baseline ``bench/prefix_salt.py``
compares against.

**Owners and forgetting**: every cached block remembers the (tenant, user) of each request that
computed or reused it; ``forget(owner)`` drops that user's blocks from the cache (free ones at
once, ones that running requests hold are unregistered and freed when those finish), so an
erased user's prefixes are not served again.

Allocation is lazy (``allocate_slots`` grows a request's table to the tokens it computes this step);
``reserve`` callers (the worst-case baseline) simply ask for prompt + max_new_tokens at once.
"""

from __future__ import annotations

import collections
import functools
import hashlib
from array import array
from typing import Callable, Sequence

ROOT_HASH = b"chatpipe-prefix-root"
DEFAULT_TENANT = "default"  # requests that name no tenant (``chatpipe generate``, tests)

Owner = tuple[str, str]  # (tenant, user_id) of a request


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Hash of one full block given its parent's hash: equal hashes <=> equal prefixes."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


@functools.lru_cache(maxsize=4096)
def tenant_root(tenant: str) -> bytes:
    """The first parent of a tenant's hash chains: tenants share no hash, so no block."""
    return hashlib.blake2b(ROOT_HASH + b"\x00tenant\x00" + tenant.encode("utf-8"), digest_size=16).digest()


@functools.lru_cache(maxsize=4096)
def adapter_root(parent: bytes, adapter_key: str) -> bytes:
    """The first parent of the chains of requests run with a LoRA adapter (its registration key)."""
    return hashlib.blake2b(parent + b"\x00adapter\x00" + adapter_key.encode("utf-8"), digest_size=16).digest()


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True, salt: bool = True) -> None:
        # num_blocks >= 1 and block_size >= 1: the engine's settings and sizing guarantee both
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.salt = salt  # per-tenant roots (False: one cache for every tenant, the bench's baseline)
        # Low block ids first: keeps the cache's hot region compact.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # Evictable cached blocks in LRU order (oldest first).
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._ref = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # hash -> block holding that prefix block
        self._tables: dict[str, list[int]] = {}
        self._registered: dict[str, int] = {}  # leading blocks of a request already looked at by register()
        # Who computed or reused each cached block, and the reverse index (for ``forget``).
        self._owners: list[set[Owner] | None] = [None] * num_blocks
        self._by_owner: dict[Owner, set[int]] = {}
        self.hit_tokens = 0  # tokens taken from the prefix cache since start
        # Prompt tokens of the admissions that looked the cache up (vLLM's prefix_cache_queries):
        # hit_tokens / queried_tokens is the hit rate. Counted by the scheduler, which does the lookup.
        self.queried_tokens = 0
        # Of those, tokens of blocks no request of the same tenant had computed or reused before:
        # always 0 with the salt (the test checks it); what the salt closes without it.
        self.cross_tenant_hit_tokens = 0
        self.evictions = 0
        self.forgotten_blocks = 0  # blocks dropped by ``forget`` since start

    # -- sizes -----------------------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_in_use_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Full blocks registered in the prefix cache (in use or evictable)."""
        return len(self._cached)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def used_tokens(self) -> int:
        """Token slots held by requests (whole blocks); evictable cached blocks do not count."""
        return self.num_in_use_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.num_blocks

    # -- prefix cache ----------------------------------------------------------------------------

    def root(self, tenant: str, adapter_key: str | None = None) -> bytes:
        """The chain's first parent: the tenant's (with the salt), then the adapter's. The adapter
        joins even without the salt: its K/V differ from the base model's for the same tokens, so
        sharing them would be wrong, not only visible."""
        root = tenant_root(tenant) if self.salt else ROOT_HASH
        return root if adapter_key is None else adapter_root(root, adapter_key)

    def hashes_of(self, token_at: Callable[[int], int], num_tokens: int, known: list[bytes],
                  tenant: str = DEFAULT_TENANT, adapter_key: str | None = None) -> list[bytes]:
        """Extend ``known`` (the hash chain of a request's first full blocks) to every full block of
        its first ``num_tokens`` tokens; returns ``known``. Incremental: each block is hashed once,
        so a decode step costs nothing here until a block fills (no work that grows with context).
        The chain starts at the tenant's root (``tenant_root``), the adapter's under it if any."""
        bs = self.block_size
        for i in range(len(known), num_tokens // bs):
            tokens = [token_at(p) for p in range(i * bs, (i + 1) * bs)]
            known.append(block_hash(known[-1] if known else self.root(tenant, adapter_key), tokens))
        return known

    def cached_prefix(self, hashes: Sequence[bytes], max_blocks: int) -> list[int]:
        """The blocks of the longest cached prefix (at most ``max_blocks``), without taking them."""
        if not self.prefix_caching:
            return []
        blocks = []
        for h in hashes[:max_blocks]:
            b = self._cached.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def register(self, request_id: str, hashes: Sequence[bytes], num_full_blocks: int,
                 owner: Owner = (DEFAULT_TENANT, "")) -> None:
        """Record that the request's first ``num_full_blocks`` blocks are full and computed (their
        hashes are ``hashes[:num_full_blocks]``), so later requests may reuse them. A block whose
        prefix another block already caches stays private (that block gets ``owner`` too: it
        holds the same text). Only blocks not looked at by an earlier call are looked at."""
        if not self.prefix_caching:
            return
        table = self._tables.get(request_id, [])
        start = self._registered.get(request_id, 0)
        end = min(num_full_blocks, len(hashes), len(table))
        for i in range(start, end):
            h, b = hashes[i], table[i]
            if self._hash_of[b] is None and h not in self._cached:
                self._hash_of[b] = h
                self._cached[h] = b
                self._add_owner(b, owner)
            elif h in self._cached:
                self._add_owner(self._cached[h], owner)
        self._registered[request_id] = max(start, end)

    def note_reuse(self, blocks: Sequence[int], owner: Owner) -> int:
        """A request of ``owner`` took ``blocks`` from the cache: they hold its text now too.
        Returns how many of them no request of the same tenant had computed or reused before."""
        cross = 0
        for b in blocks:
            owners = self._owners[b] or set()
            if not any(tenant == owner[0] for tenant, _ in owners):
                cross += 1
            self._add_owner(b, owner)
        self.cross_tenant_hit_tokens += cross * self.block_size
        return cross

    def forget(self, owner: Owner) -> int:
        """Drop from the cache every block ``owner``'s requests computed or reused: free ones
        become free now, ones that running requests hold stay theirs, unregistered (no later
        request finds them; they are freed when those requests finish). Returns how many."""
        blocks = list(self._by_owner.get(owner, ()))
        for b in blocks:
            self._uncache(b)
            if self._ref[b] == 0:
                del self._evictable[b]
                self._free.append(b)
        self.forgotten_blocks += len(blocks)
        return len(blocks)

    def _add_owner(self, block: int, owner: Owner) -> None:
        owners = self._owners[block]
        if owners is None:
            owners = self._owners[block] = set()
        owners.add(owner)
        self._by_owner.setdefault(owner, set()).add(block)

    def _uncache(self, block: int) -> None:
        del self._cached[self._hash_of[block]]
        self._hash_of[block] = None
        for owner in self._owners[block] or ():
            held = self._by_owner.get(owner)
            if held is not None:
                held.discard(block)
                if not held:
                    del self._by_owner[owner]
        self._owners[block] = None

    # -- allocation ------------------------------------------------------------------------------

    def fits(self, num_tokens: int, cached: Sequence[int] = (), headroom: int = 0) -> bool:
        """Whether a new request starting with ``cached`` blocks can get blocks for ``num_tokens``
        tokens and still leave ``headroom`` blocks free."""
        taking_evictable = sum(1 for b in cached if self._ref[b] == 0)  # these stop being available
        need = self.blocks_for(num_tokens) - len(cached)
        return need + headroom <= self.num_free_blocks - taking_evictable

    def allocate_slots(self, request_id: str, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Grow the request's table so it covers ``num_tokens`` token slots; on its first call
        ``cached`` blocks (from ``cached_prefix``) start the table. All or nothing: False (and no
        change) when there is not enough room."""
        table = self._tables.get(request_id)
        if table is None and cached:
            if not self.fits(num_tokens, cached):
                return False
            need = self.blocks_for(num_tokens) - len(cached)
            for b in cached:
                if self._ref[b] == 0:
                    del self._evictable[b]
                self._ref[b] += 1
            self.hit_tokens += len(cached) * self.block_size
            table = self._tables[request_id] = list(cached)
            self._registered[request_id] = len(cached)  # already in the cache
        else:
            need = self.blocks_for(num_tokens) - (len(table) if table is not None else 0)
            if need > self.num_free_blocks:
                return False
            if table is None:
                table = self._tables[request_id] = []
        for _ in range(max(0, need)):
            table.append(self._take_block())
        return True

    def free(self, request_id: str) -> None:
        """Release a request's blocks. Cached ones become evictable, the tail first in LRU order
        (a prefix's first blocks are the ones most likely to be shared again)."""
        blocks = self._tables.pop(request_id, None)
        self._registered.pop(request_id, None)
        if not blocks:
            return
        for b in reversed(blocks):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._hash_of[b] is not None:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables[request_id]

    def _take_block(self) -> int:
        if self._free:
            b = self._free.pop()
        else:
            b, _ = self._evictable.popitem(last=False)  # least recently used
            self._uncache(b)
            self.evictions += 1
        self._ref[b] = 1
        return b
