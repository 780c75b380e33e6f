"""Prefix-cache salt per tenant and forgetting a user's prefixes (issue 19, points 3 and 4), on
the tiny random Llama (see conftest) and the block allocator.

Two tenants sending the same prompt share no block (and no hit); the same tenant's second
request hits, with output equal to Hugging Face ``generate``. ``forget_prefixes`` drops the
blocks a user's requests computed or reused: free ones at once, ones a running request holds
once it finishes; nobody finds them again, other users' blocks stay.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from inference.engine.block_allocator import ROOT_HASH, BlockAllocator, tenant_root
from inference.engine.errors import EngineStopped
from inference.engine.request import SamplingParams
from inference.engine.streaming import AsyncEngine
from tests.engine.conftest import hf_greedy

GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine, prompt, tenant, user="u"):
    _, req = engine.add_request(prompt, GREEDY, tenant=tenant, user_id=user)
    while engine.has_work():
        engine.step()
    return req


def test_two_tenants_with_the_same_prompt_share_no_block(engine_factory, tiny_model):
    engine = engine_factory(kv_block_size=4)
    prompt = tokens(30, 1)
    a = run(engine, prompt, "acme")
    b = run(engine, prompt, "globex")
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0  # globex computed all of it itself
    assert a.output_token_ids == b.output_token_ids == hf_greedy(tiny_model, prompt, GREEDY.max_new_tokens)
    assert set(a.block_hashes).isdisjoint(b.block_hashes)
    # Both tenants' copies are cached side by side: 7 full blocks each (prompt 30 + 5 computed outputs).
    assert engine.stats().kv_cached_blocks == 2 * (35 // 4)
    assert engine.stats().prefix_cache_cross_tenant_hit_tokens == 0


def test_running_together_two_tenants_hold_disjoint_blocks(engine_factory):
    engine = engine_factory(kv_block_size=4, max_step_tokens=64)
    prompt = tokens(24, 2)
    run(engine, prompt, "acme")  # acme's blocks are cached now
    _, a = engine.add_request(prompt, GREEDY, tenant="acme", user_id="u2")
    _, b = engine.add_request(prompt, GREEDY, tenant="globex", user_id="u2")
    engine.step()  # both admitted in one step
    assert a.num_cached_tokens == 20 and b.num_cached_tokens == 0  # acme hits its own cache only
    assert set(engine.allocator.block_table(a.request_id)).isdisjoint(engine.allocator.block_table(b.request_id))
    while engine.has_work():
        engine.step()
    assert a.output_token_ids == b.output_token_ids


def test_the_same_tenant_hits_across_users_and_conversations(engine_factory, tiny_model):
    engine = engine_factory(kv_block_size=4)
    system = tokens(21, 3)
    first = run(engine, system + tokens(5, 4), "acme", "ada")
    second = run(engine, system + tokens(7, 5), "acme", "bob")
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 20  # the 5 full blocks of the shared system prompt
    assert second.output_token_ids == hf_greedy(tiny_model, system + tokens(7, 5), GREEDY.max_new_tokens)
    assert engine.stats().prefix_cache_cross_tenant_hit_tokens == 0


def test_without_the_salt_one_tenant_hits_another_tenants_blocks(engine_factory):
    """The side channel the salt closes (the bench's baseline): counted as cross-tenant hits."""
    engine = engine_factory(kv_block_size=4, prefix_cache_salt=False)
    prompt = tokens(30, 1)
    run(engine, prompt, "acme")
    b = run(engine, prompt, "globex")
    assert b.num_cached_tokens == 28 and b.num_cross_tenant_cached_tokens == 28
    assert engine.stats().prefix_cache_cross_tenant_hit_tokens == 28


def test_tenant_roots_differ_and_default_chains_are_salted_too():
    assert len({tenant_root(t) for t in ("acme", "globex", "default", "")} | {ROOT_HASH}) == 5
    salted, plain = BlockAllocator(8, 4), BlockAllocator(8, 4, salt=False)
    ids = list(range(8))
    assert salted.hashes_of(ids.__getitem__, 8, [], "acme") != salted.hashes_of(ids.__getitem__, 8, [], "globex")
    assert plain.hashes_of(ids.__getitem__, 8, [], "acme") == plain.hashes_of(ids.__getitem__, 8, [], "globex")


def test_forget_drops_the_users_free_blocks_and_keeps_the_others(engine_factory, tiny_model):
    engine = engine_factory(kv_block_size=4)
    ada_prompt, bob_prompt = tokens(30, 6), tokens(30, 7)
    run(engine, ada_prompt, "acme", "ada")
    run(engine, bob_prompt, "acme", "bob")
    run(engine, ada_prompt, "globex", "ada")  # another tenant's user of the same id
    cached = engine.stats().kv_cached_blocks
    assert engine.forget_prefixes("acme", "ada") == 35 // 4
    s = engine.stats()
    assert s.kv_cached_blocks == cached - 35 // 4 and s.prefix_cache_forgotten_blocks == 35 // 4
    assert s.kv_free_blocks == s.kv_capacity_tokens // 4 - s.kv_cached_blocks  # dropped blocks are free now
    again = run(engine, ada_prompt, "acme", "carol")  # nobody of acme finds ada's prefix any more
    assert again.num_cached_tokens == 0
    assert again.output_token_ids == hf_greedy(tiny_model, ada_prompt, GREEDY.max_new_tokens)
    assert run(engine, bob_prompt, "acme", "bob").num_cached_tokens == 28  # bob's stay
    assert run(engine, ada_prompt, "globex", "ada").num_cached_tokens == 28  # globex's ada is another user
    assert engine.forget_prefixes("acme", "nobody") == 0


def test_forget_also_drops_blocks_the_user_only_reused(engine_factory):
    """Bob's request reused Ada's system-prompt blocks: they hold Bob's text too."""
    engine = engine_factory(kv_block_size=4)
    system = tokens(20, 8)
    run(engine, system + tokens(3, 9), "acme", "ada")
    run(engine, system + tokens(3, 10), "acme", "bob")
    assert engine.forget_prefixes("acme", "bob") >= 5
    assert run(engine, system + tokens(3, 11), "acme", "ada").num_cached_tokens == 0


def test_forget_while_the_user_runs_unregisters_and_frees_when_done(engine_factory, tiny_model):
    engine = engine_factory(kv_block_size=4, max_step_tokens=64)
    prompt = tokens(30, 12)
    _, req = engine.add_request(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True), tenant="acme",
                                user_id="ada")
    engine.step()
    engine.step()  # prompt computed and registered, decoding now
    held = list(engine.allocator.block_table(req.request_id))
    assert engine.forget_prefixes("acme", "ada") == 30 // 4
    assert engine.stats().kv_cached_blocks == 0  # unregistered at once, still held by the request
    while engine.has_work():
        engine.step()
    assert req.output_token_ids == hf_greedy(tiny_model, prompt, 12)  # the running request is unharmed
    s = engine.stats()
    assert s.kv_cached_blocks == 0  # it cached nothing more after the forget
    assert s.kv_in_use_blocks == 0 and s.kv_evictable_blocks == 0
    assert set(held) <= set(engine.allocator._free)  # freed when it finished, not evictable
    assert run(engine, prompt, "acme", "bob").num_cached_tokens == 0


def test_async_forget_runs_on_the_step_thread(engine_factory):
    engine = engine_factory(kv_block_size=4)
    prompt = tokens(30, 13)

    async def scenario() -> int:
        aengine = AsyncEngine(engine, idle_wait_s=0.01)
        aengine.start()
        stream = aengine.submit(prompt, GREEDY, tenant="acme", user_id="ada")
        async for _ in stream:
            pass
        dropped = await aengine.forget_prefixes("acme", "ada")
        await asyncio.to_thread(aengine.stop)
        with pytest.raises(EngineStopped):
            await aengine.forget_prefixes("acme", "ada")
        return dropped

    assert asyncio.run(scenario()) == 35 // 4
    assert engine.stats().kv_cached_blocks == 0
