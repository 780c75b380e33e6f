"""Prefix caching (issue 10) on the tiny random Llama (see conftest) and on the block allocator:
greedy output with the cache on equals output with it off and Hugging Face ``generate``, token
for token, for multi-turn conversations and a shared system prompt; cached blocks are reused,
visible in ``Engine.stats()``, and evicted least-recently-used only when space is needed."""

from __future__ import annotations

import torch

from inference.engine.block_allocator import BlockAllocator
from inference.engine.request import SamplingParams
from tests.engine.conftest import hf_greedy

GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_conversation(engine, system: list[int], turns: list[list[int]]) -> list[list[int]]:
    """Each turn resends the whole history (previous prompt + answer + the new user tokens)."""
    history, outputs = list(system), []
    for user in turns:
        history += user
        out = engine.generate([history], GREEDY)[0]
        outputs.append(out)
        history += out
    return outputs


def test_multi_turn_output_with_cache_equals_without_and_hf(engine_factory, tiny_model):
    """Guards against a reused prefix giving different K/V (wrong positions, a block shared before
    it was full, a stale block) and so a different answer in later turns of a conversation."""
    system, turns = tokens(21, 1), [tokens(n, 10 + i) for i, n in enumerate([9, 14, 5, 11])]
    cached_engine = engine_factory(kv_block_size=4)
    with_cache = run_conversation(cached_engine, system, turns)
    without = run_conversation(engine_factory(kv_block_size=4, prefix_caching=False), system, turns)
    assert with_cache == without
    history = list(system)
    for user, out in zip(turns, with_cache):
        history += user
        assert out == hf_greedy(tiny_model, history, GREEDY.max_new_tokens)
        history += out
    stats = cached_engine.stats()
    # Every later turn found its history: at least the previous turns' prompts came from the cache.
    assert stats.prefix_cache_hit_tokens >= (21 + 9) // 4 * 4 + (21 + 9 + 8 + 14) // 4 * 4
    assert stats.prompt_tokens < sum(len(system) + sum(len(t) for t in turns[: i + 1]) + 8 * i for i in range(4))
    assert stats.kv_in_use_blocks == 0 and stats.kv_cached_blocks == stats.kv_evictable_blocks > 0


def test_shared_system_prompt_across_concurrent_requests(engine_factory, tiny_model):
    """Guards against requests that share a cached system prompt while running together reading
    each other's private blocks (or writing into a shared one)."""
    engine = engine_factory(kv_block_size=4, max_step_tokens=16)
    system = tokens(30, 2)
    engine.generate([system + tokens(3, 99)], GREEDY)  # warms the cache with the system prompt
    prompts = [system + tokens(n, 20 + n) for n in (1, 7, 12, 4)]
    reqs = []
    for p in prompts:  # staggered: each arrives while the others decode
        reqs.append(engine.add_request(p, GREEDY)[1])
        engine.step()
    while engine.has_work():
        engine.step()
    for p, r in zip(prompts, reqs):
        assert r.output_token_ids == hf_greedy(tiny_model, p, GREEDY.max_new_tokens)
        assert r.num_cached_tokens == 28  # 7 full blocks of the 30-token system prompt
    stats = engine.stats()
    assert stats.prefix_cache_hit_tokens >= 4 * 28
    # vLLM's prefix_cache_queries: the prompt tokens of every admission that looked the cache up
    # (the warm-up's and the four), so hits / queries is the hit rate /metrics shows.
    assert stats.prefix_cache_queried_tokens == 33 + sum(len(p) for p in prompts)
    assert stats.prefix_cache_hit_tokens <= stats.prefix_cache_queried_tokens


def test_eviction_under_pressure_keeps_outputs_exact(engine_factory, tiny_model):
    """Guards against evicting a block still in use, or reusing an evicted block's stale hash: a
    cache too small for all conversations must evict, and every answer must stay exact."""
    engine = engine_factory(kv_block_size=4, kv_cache_tokens=64, max_batch=2, max_seq_len=64)
    prompts = [tokens(30, s) for s in (3, 4, 5)]
    for p in prompts + prompts[:1]:  # 3 x 8 blocks of cache for 16 blocks: the first is evicted
        assert engine.generate([p], GREEDY)[0] == hf_greedy(tiny_model, p, GREEDY.max_new_tokens)
    assert engine.allocator.evictions > 0
    s = engine.stats()
    assert s.kv_in_use_blocks == 0 and s.kv_evictable_blocks + s.kv_free_blocks == 16


def test_allocator_evicts_least_recently_used_and_only_when_needed():
    """Guards against evicting cached blocks while free ones remain, or in the wrong order."""
    a = BlockAllocator(num_blocks=6, block_size=2)
    known: dict[str, list[bytes]] = {}

    def run(rid: str, toks: list[int]) -> list[int]:
        hashes = a.hashes_of(toks.__getitem__, len(toks), known.setdefault(rid, []))
        cached = a.cached_prefix(hashes, len(hashes))
        assert a.allocate_slots(rid, len(toks), cached)
        a.register(rid, hashes, len(hashes))
        a.free(rid)
        return cached

    run("x", [1, 2, 3, 4])  # 2 blocks cached
    run("y", [5, 6, 7, 8])  # 2 more; 2 free blocks remain
    assert a.num_cached_blocks == 4 and a.evictions == 0
    assert len(run("x2", [1, 2, 3, 4])) == 2  # x again: a full hit, and x becomes most recent
    run("z", [9, 9, 8, 8, 7, 7])  # 3 blocks: 2 free + 1 evicted, y's tail first
    assert a.evictions == 1
    assert len(run("x3", [1, 2, 3, 4])) == 2  # x survived
    assert len(run("y2", [5, 6, 7, 8])) == 1  # y lost its last block only


def test_cache_off_setting_disables_reuse(engine_factory, monkeypatch):
    """Guards against the off switch (CHATPIPE_PREFIX_CACHING=false) not reaching the settings, or
    still sharing blocks."""
    from inference.engine.settings import EngineSettings

    monkeypatch.setenv("CHATPIPE_PREFIX_CACHING", "false")
    assert EngineSettings().prefix_caching is False
    engine = engine_factory(prefix_caching=False)
    p = tokens(20, 7)
    engine.generate([p, p], GREEDY)
    s = engine.stats()
    assert s.prefix_cache_hit_tokens == 0 and s.kv_cached_blocks == 0 and s.prompt_tokens == 40
    assert s.prefix_cache_queried_tokens == 0  # no cache, no lookups
