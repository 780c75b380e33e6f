"""The issue's acceptance test on the real default model (SmolLM2-135M-Instruct, float32, CPU):
prompts of very different lengths, arriving at different steps and sharing the batch with chunked
prefill, give exactly Hugging Face ``generate``'s greedy output for each prompt alone."""

from __future__ import annotations

import pytest

from inference.engine.engine import Engine
from inference.engine.request import FinishReason, SamplingParams
from inference.engine.settings import EngineSettings
from inference.engine.text import encode_prompt
from tests.engine.conftest import hf_greedy

pytestmark = pytest.mark.model

QUESTIONS = [
    "Hi",
    "What is the capital of France?",
    "Explain in detail how a steam engine works, covering the boiler, the piston, the valves, the "
    "condenser and the history of its invention, and compare it with the internal combustion engine. " * 9,
    "List three colors.",
    "Write a haiku about Kafka topics and streaming data pipelines.",
]


def test_staggered_greedy_outputs_equal_hf_generate_alone(default_model):
    """Guards against any batching artefact (positions, masks, paged cache, chunked prefill mixed
    with decode, GQA) changing a single token of the real model's greedy output."""
    model, tokenizer = default_model
    settings = EngineSettings(device="cpu", dtype="float32", max_batch=4, max_step_tokens=96, kv_block_size=16,
                              kv_cache_tokens=2048)  # fmt: skip
    engine = Engine(model, settings)
    prompts = [encode_prompt(tokenizer, q) for q in QUESTIONS]
    assert max(map(len, prompts)) > 8 * min(map(len, prompts))  # 31 vs ~330 tokens
    params = SamplingParams(max_new_tokens=24)
    reqs = []
    for p in prompts:  # a new arrival every second step, into a running batch
        reqs.append(engine.add_request(p, params)[1])
        engine.step()
        engine.step()
    while engine.has_work():
        engine.step()
    for p, r in zip(prompts, reqs):
        eos = model.generation_config.eos_token_id
        assert r.output_token_ids == hf_greedy(model, p, params.max_new_tokens, eos=eos), tokenizer.decode(p)
    assert any(r.finish_reason is FinishReason.STOP for r in reqs)  # EOS handling exercised too


def test_same_seed_same_sampled_text(default_model):
    """Guards against seeded sampling that is not reproducible on the real model."""
    model, tokenizer = default_model
    prompt = encode_prompt(tokenizer, "Tell me a joke.")
    params = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=7)
    runs = [Engine(model, EngineSettings(device="cpu", kv_cache_tokens=256)).generate([prompt], params)[0] for _ in range(2)]
    assert runs[0] == runs[1]


def test_cli_generate_streams_an_answer(default_model):
    """Guards against `chatpipe generate` not producing text from the default model."""
    from typer.testing import CliRunner

    from chatpipe.cli import app

    result = CliRunner().invoke(app, ["generate", "What is the capital of France?", "-n", "12", "--no-stats"])
    assert result.exit_code == 0, result.output
    assert "Paris" in result.output


def test_multi_turn_and_shared_system_prompt_with_prefix_cache_equal_cache_off(default_model):
    """Guards against the prefix cache changing a token of the real model's greedy output: a
    3-turn conversation (each turn resends the history through the chat template) and two requests
    sharing a long system prompt give the same tokens with the cache on as off, and as HF alone."""
    model, tokenizer = default_model
    eos = model.generation_config.eos_token_id
    system = "You are a terse assistant for a data-pipeline team. Answer in one short sentence. " * 2
    settings = dict(device="cpu", dtype="float32", max_batch=4, max_step_tokens=128, kv_block_size=16, kv_cache_tokens=2048)
    params = SamplingParams(max_new_tokens=8)

    def conversation(engine: Engine) -> list[list[int]]:
        messages, outs = [{"role": "system", "content": system}], []
        for question in ("What is Kafka?", "And a topic?", "Name one consumer setting."):
            messages.append({"role": "user", "content": question})
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            prompt = tokenizer.encode(text, add_special_tokens=False)
            out = engine.generate([prompt], params)[0]
            outs.append((prompt, out))
            messages.append({"role": "assistant", "content": tokenizer.decode(out, skip_special_tokens=True)})
        shared = [encode_prompt(tokenizer, q, system=system) for q in ("Hi", "What is a partition?")]
        return outs + list(zip(shared, engine.generate(shared, params)))

    cached = Engine(model, EngineSettings(**settings))
    on = conversation(cached)
    off = conversation(Engine(model, EngineSettings(**settings, prefix_caching=False)))
    assert [o for _, o in on] == [o for _, o in off]
    assert cached.stats().prefix_cache_hit_tokens > 3 * 32  # later turns and the shared prompt hit
    for prompt, out in (on[2], on[4]):  # the last turn and a shared-prompt request, against HF alone
        assert out == hf_greedy(model, prompt, params.max_new_tokens, eos=eos), tokenizer.decode(prompt)
