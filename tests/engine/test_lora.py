"""LoRA adapters in the engine: rows of different adapters and of the base model in one step, each
exactly as Hugging Face ``generate`` on the base with that adapter merged by peft; slots, loading and
failures; the prefix cache kept apart per adapter.

The adapters are peft's own (``lora_fixtures``: random factors, saved by ``save_pretrained``). The tiny
model's tests run everywhere; the default model's (marked ``model``) are the issue's exactness line.
"""

from __future__ import annotations

import pytest

from inference.engine.engine import Engine
from inference.engine.errors import InvalidRequestError
from inference.engine.lora import AdapterError
from inference.engine.request import FinishReason, SamplingParams
from inference.engine.settings import EngineSettings
from tests.engine.conftest import hf_greedy
from chatpipe.testing.lora_adapters import make_adapter, merged_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5], [1, 2, 3, 4, 5, 6, 7, 8, 9], [7, 7, 7, 7, 7], [9, 8, 7, 6]]


@pytest.fixture(scope="module")
def tiny_adapters(tiny_model, tmp_path_factory):
    """x: rank 8 on every projection; y: rank 4 on q and v only (the bank pads and skips)."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "x": make_adapter(tiny_model, root / "x", seed=1),
        "y": make_adapter(tiny_model, root / "y", seed=2, r=4, targets=("q_proj", "v_proj")),
    }


def run(engine: Engine, jobs: list[tuple[list[int], str | None]], max_new_tokens: int = 10):
    reqs = [engine.add_request(p, SamplingParams(max_new_tokens=max_new_tokens), adapter=a)[1] for p, a in jobs]
    while engine.has_work():
        engine.step()
    return reqs


@pytest.mark.parametrize("lean", ["off", "on"])
def test_mixed_step_equals_each_adapter_merged_by_peft(engine_factory, tiny_model, tiny_adapters, lean):
    engine = engine_factory(max_batch=8, lean_layers=lean)
    for name, folder in tiny_adapters.items():
        engine.register_adapter(name, folder)
    jobs = list(zip(PROMPTS, ["x", None, "y", "x", None]))
    reqs = run(engine, jobs)
    refs = {None: tiny_model, **{n: merged_model(tiny_model, f) for n, f in tiny_adapters.items()}}
    for (prompt, name), req in zip(jobs, reqs):
        assert req.output_token_ids == hf_greedy(refs[name], prompt, 10), (name, prompt)
    # The adapters change the answers (else the test would prove nothing), and ran in shared steps.
    assert reqs[0].output_token_ids != hf_greedy(tiny_model, PROMPTS[0], 10)
    assert engine.stats().steps < sum(10 + 1 for _ in jobs)


def test_lru_slots_one_in_memory_and_a_load_never_stops_the_step_loop(engine_factory, tiny_model, tiny_adapters):
    import threading

    engine = engine_factory(max_batch=8, max_loras=1)
    for name, folder in tiny_adapters.items():
        engine.register_adapter(name, folder)
    loading = threading.Event()  # the loader thread reads the files only once the test lets it
    read_files = engine.adapters.loader
    engine.adapters.loader = lambda name, folder: (loading.wait(30), read_files(name, folder))[1]
    base = engine.add_request(PROMPTS[1], SamplingParams(max_new_tokens=30))[1]
    engine.step()
    first = engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=6), adapter="x")[1]
    second = engine.add_request(PROMPTS[2], SamplingParams(max_new_tokens=6), adapter="y")[1]
    for _ in range(5):  # x is loading: the base request goes on, x waits at the queue's head
        engine.step()
    assert len(base.output_token_ids) == 6 and first.output_token_ids == [] and second.output_token_ids == []
    loading.set()
    while engine.has_work():
        engine.step()
    stats = engine.adapter_stats()
    assert (stats.loads, stats.evictions, stats.resident) == (2, 1, ("y",))  # y took x's slot once x was done
    assert first.output_token_ids == hf_greedy(merged_model(tiny_model, tiny_adapters["x"]), PROMPTS[0], 6)
    assert second.output_token_ids == hf_greedy(merged_model(tiny_model, tiny_adapters["y"]), PROMPTS[2], 6)
    assert base.output_token_ids == hf_greedy(tiny_model, PROMPTS[1], 30)


def test_a_waiting_request_holds_no_slot_so_a_queue_head_needing_one_never_waits_forever(engine_factory, tiny_model,
                                                                                           tiny_adapters):
    """One slot: x runs; y (the queue's head) needs the slot; another x request waits behind y. Were waiting
    requests to hold their adapter's slot, y would wait for x's slot and the second x for y: forever."""
    engine = engine_factory(max_batch=8, max_loras=1)
    for name, folder in tiny_adapters.items():
        engine.register_adapter(name, folder)
    running = engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=4), adapter="x")[1]
    engine.step()
    head = engine.add_request(PROMPTS[2], SamplingParams(max_new_tokens=4), adapter="y")[1]
    behind = engine.add_request(PROMPTS[3], SamplingParams(max_new_tokens=4), adapter="x")[1]
    for _ in range(200):
        if not engine.has_work():
            break
        engine.step()
    assert all(r.finish_reason is FinishReason.LENGTH for r in (running, head, behind))
    merged = {n: merged_model(tiny_model, f) for n, f in tiny_adapters.items()}
    assert head.output_token_ids == hf_greedy(merged["y"], PROMPTS[2], 4)
    assert behind.output_token_ids == hf_greedy(merged["x"], PROMPTS[3], 4)
    stats = engine.adapter_stats()
    assert (stats.loads, stats.evictions) == (3, 2)  # x, y, x again


def test_prefix_cache_never_shares_blocks_across_adapters(engine_factory, tiny_adapters):
    engine = engine_factory()
    engine.register_adapter("x", tiny_adapters["x"])
    prompt = list(range(1, 30))
    (base,) = run(engine, [(prompt, None)], 2)
    (with_x,) = run(engine, [(prompt, "x")], 2)
    (again_x,) = run(engine, [(prompt, "x")], 2)
    (again_base,) = run(engine, [(prompt, None)], 2)
    assert with_x.num_cached_tokens == 0  # the base model's blocks are not the adapter's
    assert again_x.num_cached_tokens > 0 and again_base.num_cached_tokens > 0  # within each, the cache works
    # A name registered again for another folder is another cache: the old blocks are not served.
    engine.register_adapter("x", tiny_adapters["y"])
    (replaced,) = run(engine, [(prompt, "x")], 2)
    assert replaced.num_cached_tokens == 0


def test_a_corrupt_adapter_fails_its_requests_with_the_reason_and_serving_goes_on(engine_factory, tiny_model,
                                                                                   tiny_adapters, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_adapters["x"], bad)
    weights = bad / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated mid-file
    engine = engine_factory()
    engine.register_adapter("bad", bad)
    engine.register_adapter("x", tiny_adapters["x"])
    failed, base, good = run(engine, [(PROMPTS[0], "bad"), (PROMPTS[1], None), (PROMPTS[2], "x")], 5)
    assert failed.finish_reason is FinishReason.ERROR and "adapter_model.safetensors is not readable" in failed.error
    assert failed.output_token_ids == []
    assert base.output_token_ids == hf_greedy(tiny_model, PROMPTS[1], 5)
    assert good.output_token_ids == hf_greedy(merged_model(tiny_model, tiny_adapters["x"]), PROMPTS[2], 5)
    assert engine.adapter_stats().load_failures == 1


def test_an_adapter_of_another_model_is_refused_at_load_with_the_shapes(engine_factory, tmp_path):
    from tests.engine.conftest import make_tiny_model

    other = make_tiny_model(seed=3, vocab_size=256)
    other.model.layers[0].self_attn.q_proj = type(other.model.layers[0].self_attn.q_proj)(64, 32, bias=False)
    folder = make_adapter(other, tmp_path / "other", seed=4, targets=("q_proj",))
    engine = engine_factory()
    engine.register_adapter("other", folder)
    (req,) = run(engine, [(PROMPTS[0], "other")], 3)
    assert req.finish_reason is FinishReason.ERROR
    assert "do not fit the model's [64, 64] projection" in req.error


def test_unknown_unregistered_and_unreadable_adapters_are_named(engine_factory, tiny_adapters, tmp_path):
    engine = engine_factory()
    with pytest.raises(InvalidRequestError, match="adapter 'nope' is not registered with this engine"):
        engine.add_request(PROMPTS[0], adapter="nope")
    with pytest.raises(AdapterError, match="not a LoRA adapter folder: no adapter_config.json"):
        engine.register_adapter("empty", tmp_path)
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "use_dora": true}')
    with pytest.raises(AdapterError, match="DoRA"):
        engine.register_adapter("dora", tmp_path)
    engine.register_adapter("x", tiny_adapters["x"])
    running = engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=4), adapter="x")[1]
    engine.step()
    assert engine.retire_adapter("x")
    with pytest.raises(InvalidRequestError, match="not registered"):
        engine.add_request(PROMPTS[0], adapter="x")
    while engine.has_work():
        engine.step()
    assert running.finish_reason is FinishReason.LENGTH  # a retired adapter finishes what it started
    engine.step()
    assert engine.adapter_stats().resident == ()  # and then leaves memory


@pytest.mark.model
def test_default_model_mixed_batch_equals_peft_merged_generate(default_model, tmp_path):
    """The issue's exactness line: adapter X's request, in steps shared with base-model requests and
    adapter Y's, gives the greedy tokens of HF ``generate`` on the base with X merged by peft."""
    from inference.engine.text import encode_prompt

    model, tokenizer = default_model
    x = make_adapter(model, tmp_path / "x", seed=11, r=16, alpha=32, b_scale=0.2)
    y = make_adapter(model, tmp_path / "y", seed=12, r=8, targets=("q_proj", "v_proj"), b_scale=0.2)
    engine = Engine(model, EngineSettings(device="cpu", dtype="float32", max_batch=6, max_step_tokens=64,
                                          kv_block_size=16, kv_cache_tokens=2048))  # fmt: skip
    engine.register_adapter("x", x)
    engine.register_adapter("y", y)
    questions = ["What is the capital of France?", "List three colors.", "Write a haiku about Kafka.",
                 "Hi", "What is the capital of France?"]
    jobs = list(zip([encode_prompt(tokenizer, q) for q in questions], ["x", None, "y", "x", None]))
    reqs = run(engine, jobs, max_new_tokens=16)
    eos = model.generation_config.eos_token_id
    refs = {None: model, "x": merged_model(model, x), "y": merged_model(model, y)}
    for (prompt, name), req in zip(jobs, reqs):
        assert req.output_token_ids == hf_greedy(refs[name], prompt, 16, eos=eos), (name, tokenizer.decode(prompt))
    assert reqs[0].output_token_ids != reqs[4].output_token_ids  # X answers otherwise than the base
