"""Issue 23's sampling features in the engine: OpenAI presence / frequency penalties, raw
logprobs, a per-request token constraint (xgrammar ``GrammarMatcher``), n > 1 siblings sharing the
prompt's KV, and seeds. Hand-made logits and the tiny random Llama (see conftest) for the
mechanics; the real default model for what a user sees (penalties against a hand computation on
its logits, logprobs against a Hugging Face forward, JSON valid for a schema)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest
import torch

from inference.engine.engine import Engine, eos_token_ids
from inference.engine.errors import InvalidRequestError
from inference.engine.request import Admission, FinishReason, SamplingParams
from inference.engine.sampling import Sampler
from inference.engine.settings import EngineSettings
from inference.engine.streaming import AsyncEngine
from inference.engine.text import encode_prompt
from tests.engine.conftest import hf_greedy


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine: Engine) -> list:
    events = []
    while engine.has_work():
        events += engine.step()
    return events


# -- parameters ------------------------------------------------------------------------------------


def test_new_params_are_validated():
    """Guards against out-of-range penalties or logprobs reaching the sampler (OpenAI's bounds)."""
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-2.01), dict(presence_penalty=float("nan")),
                dict(logprobs=-1), dict(logprobs=21), dict(logprobs=True), dict(logprobs=1.5)):  # fmt: skip
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad)
    ok = SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, logprobs=20)
    assert ok.penalized and SamplingParams(logprobs=0).logprobs == 0 and not SamplingParams().penalized


# -- the sampler on hand-made logits ----------------------------------------------------------------


def test_penalties_follow_openai_on_the_output_tokens_only():
    """Guards against penalties counting the prompt, counting presence like frequency, or
    touching rows that asked for none: logit[j] -= frequency * count[j] + presence * (count[j] > 0)."""
    torch.manual_seed(0)
    raw = torch.randn(3, 10)
    logits = raw.clone()
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), SamplingParams(),
              SamplingParams(presence_penalty=-1.0)]  # fmt: skip
    outputs = [[3, 3, 7], [3, 3], [9]]
    sampler = Sampler("cpu")
    res = sampler.sample_step(logits, ["a", "b", "c"], params, outputs)
    expected = raw.clone()
    expected[0, 3] -= 0.5 * 2 + 0.25
    expected[0, 7] -= 0.5 + 0.25
    expected[2, 9] += 1.0
    assert torch.allclose(logits, expected, atol=1e-6, rtol=0)
    assert res.token_ids == expected.argmax(-1).tolist()
    # The next step counts the token just chosen (kept on the device, not rebuilt).
    outputs[0].append(res.token_ids[0])
    again = raw.clone()
    sampler.sample_step(again[:1], ["a"], params[:1], outputs[:1])
    counts = torch.bincount(torch.tensor(outputs[0]), minlength=10).float()
    assert torch.allclose(again[0], raw[0] - 0.5 * counts - 0.25 * (counts > 0), atol=1e-6, rtol=0)


def test_logprobs_are_raw_and_the_top_k_sorted():
    """Guards against logprobs taken after penalties/temperature (OpenAI clients expect the model's
    distribution; we document raw), a top list that is unsorted, too long, or misses the token."""
    torch.manual_seed(1)
    raw = torch.randn(3, 50)
    params = [SamplingParams(logprobs=5, frequency_penalty=2.0), SamplingParams(),
              SamplingParams(logprobs=0, temperature=0.7, seed=3)]  # fmt: skip
    sampler = Sampler("cpu")
    sampler.add("c", params[2])
    res = sampler.sample_step(raw.clone(), ["a", "b", "c"], params, [[int(raw[0].argmax())] * 3, [], []])
    ref = torch.log_softmax(raw, -1)
    assert res.logprobs[1] is None and res.top_logprobs[1] is None
    assert res.logprobs[0] == pytest.approx(ref[0, res.token_ids[0]].item(), abs=1e-6)
    assert res.token_ids[0] != int(raw[0].argmax())  # the penalty moved the choice, not the logprobs
    top = res.top_logprobs[0]
    assert [t for t, _ in top] == ref[0].topk(5).indices.tolist()
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    assert top[0][1] == pytest.approx(ref[0].max().item(), abs=1e-6)
    assert res.top_logprobs[2] == () and res.logprobs[2] == pytest.approx(ref[2, res.token_ids[2]].item(), abs=1e-6)


class AllowOnly:
    """A constraint (GrammarMatcher's protocol) allowing one fixed set of token ids; with ``stop``,
    only ``stop`` from the ``stop_after``-th token on, and accepting it terminates."""

    def __init__(self, allowed: set[int], vocab: int, stop: int | None = None, stop_after: int = 0):
        self.allowed, self.vocab, self.stop, self.accepted, self.done = allowed, vocab, stop, [], False
        self.stop_after = stop_after

    def _now(self) -> set[int]:
        return {self.stop} if self.stop is not None and len(self.accepted) >= self.stop_after else self.allowed

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> bool:
        bits = torch.zeros(bitmask.shape[1] * 32, dtype=torch.int64)
        bits[list(self._now())] = 1
        words = (bits.view(-1, 32) << torch.arange(32)).sum(-1)
        bitmask[index] = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        return True

    def accept_token(self, token_id: int) -> bool:
        ok = token_id in self._now()
        self.accepted.append(token_id)
        self.done = token_id == self.stop
        return ok

    def is_terminated(self) -> bool:
        return self.done


def test_a_mixed_step_costs_one_device_to_host_copy(monkeypatch):
    """Guards against a sampler that syncs per row (int() of each draw) or per feature: a step with
    greedy, sampled (top-k, top-p), penalised, logprob and constrained rows copies to the host
    once (issue 22: one sync per step)."""
    import xgrammar  # noqa: F401 - imported before counting (the sampler imports it lazily)

    torch.manual_seed(2)
    logits = torch.randn(5, 70)
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=5, seed=1),
              SamplingParams(temperature=0.8, top_p=0.5, seed=2, logprobs=3),
              SamplingParams(frequency_penalty=1.0, logprobs=0), SamplingParams()]  # fmt: skip
    ids = list("abcde")
    sampler = Sampler("cpu")
    for rid, p in zip(ids, params):
        sampler.add(rid, p)
    constraint = AllowOnly({4, 40}, 70)
    copies = []
    for name in ("tolist", "item", "__int__", "__float__", "__bool__", "__index__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k: copies.append(_n) or _o(self, *a, **k))
    res = sampler.sample_step(logits, ids, params, [[], [], [], [1, 1], []], [None, None, None, None, constraint])
    monkeypatch.undo()
    assert copies == ["tolist"]
    assert res.token_ids[4] in {4, 40} and constraint.accepted == [res.token_ids[4]] and not res.rejected


# -- the engine, tiny model ------------------------------------------------------------------------


def test_constrained_rows_only_are_masked_and_termination_stops(engine_factory, tiny_model):
    """Guards against a constraint's mask leaking onto other rows of the step, a token the
    constraint never saw, or a request going on after its constraint terminated."""
    engine = engine_factory()
    free_prompt, con_prompt = tokens(9, 1), tokens(6, 2)
    constraint = AllowOnly({10, 11}, 256, stop=12, stop_after=7)
    free = engine.add_request(free_prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))[1]
    con = engine.add_request(con_prompt, SamplingParams(max_new_tokens=50, ignore_eos=True), constraint=constraint)[1]
    events = run(engine)
    assert free.output_token_ids == hf_greedy(tiny_model, free_prompt, 12)
    assert set(con.output_token_ids[:7]) <= {10, 11} and con.output_token_ids[7:] == [12]
    assert constraint.accepted == con.output_token_ids  # each token once, in order
    assert con.finish_reason is FinishReason.STOP
    assert [e.finish_reason for e in events if e.finished and e.request_id == con.request_id] == [FinishReason.STOP]


def test_a_token_the_constraint_refuses_ends_that_request_with_an_error(engine_factory):
    """Guards against a matcher/mask disagreement being ignored (output no longer constrained) or
    failing the whole engine: that request ends with ERROR and a message, the others go on."""
    class Liar(AllowOnly):
        def accept_token(self, token_id: int) -> bool:
            return False

    engine = engine_factory()
    bad = engine.add_request(tokens(5, 3), SamplingParams(max_new_tokens=9), constraint=Liar({7}, 256))[1]
    good = engine.add_request(tokens(5, 4), SamplingParams(max_new_tokens=9, ignore_eos=True))[1]
    events = run(engine)
    assert bad.finish_reason is FinishReason.ERROR and len(bad.output_token_ids) == 1
    final = [e for e in events if e.finished and e.request_id == bad.request_id][0]
    assert "constraint refused token 7" in final.error
    assert good.finish_reason is FinishReason.LENGTH and len(good.output_token_ids) == 9


def test_siblings_share_the_prompt_blocks_and_get_seed_plus_i(engine_factory, tiny_model):
    """Guards against n > 1 computing the prompt n times (no sharing), admitting siblings before
    the prompt is cached, or giving every sibling the same seed (n equal answers)."""
    prompt = tokens(13, 5)
    engine = engine_factory(kv_block_size=4)
    admission, reqs = engine.add_request_group(["g0", "g1", "g2"], prompt, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert admission is Admission.ACCEPTED
    engine.step()
    assert engine.scheduler.num_running == 1  # the leader alone computes the prompt
    run(engine)
    expected = hf_greedy(tiny_model, prompt, 6)
    assert [r.output_token_ids for r in reqs] == [expected] * 3
    assert [r.num_cached_tokens for r in reqs] == [0, 12, 12]  # the prompt's 3 full blocks of 4
    assert engine.stats().prompt_tokens == 13 + 1 + 1
    # Sampled: sibling i draws like a lone request seeded seed + i.
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=40, ignore_eos=True)
    _, group = (e := engine_factory()).add_request_group(3, prompt, params)
    run(e)
    alone = [engine_factory().generate([prompt], SamplingParams(**{**params.__dict__, "seed": 40 + i}))[0] for i in range(3)]
    assert [r.output_token_ids for r in group] == alone and len({tuple(a) for a in alone}) == 3


def test_siblings_without_prefix_caching_still_run(engine_factory, tiny_model):
    """Guards against siblings waiting forever for a cache that is off."""
    prompt = tokens(10, 6)
    engine = engine_factory(prefix_caching=False)
    _, reqs = engine.add_request_group(2, prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))
    engine.step()
    assert engine.scheduler.num_running == 2
    run(engine)
    assert all(r.output_token_ids == hf_greedy(tiny_model, prompt, 4) for r in reqs)


def test_group_is_accepted_or_refused_whole(engine_factory):
    """Guards against a partly queued group (some choices never answered)."""
    engine = engine_factory(max_waiting=3)
    assert engine.add_request_group(4, [1, 2, 3], SamplingParams(max_new_tokens=2))[0] is Admission.OVERLOADED
    assert engine.scheduler.num_waiting == 0
    with pytest.raises(InvalidRequestError, match="constraints has 1 entries"):
        engine.add_request_group(2, [1, 2], constraints=[None])


def test_seeded_output_ignores_the_rest_of_the_batch(engine_factory):
    """Guards against a seeded request's draws depending on its neighbours (a shared generator,
    a batched draw): alone, twice, and among greedy / penalised / logprob / other seeded rows, it
    gives the same tokens on CPU float32."""
    prompt = tokens(8, 7)
    params = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, top_k=40, seed=123, ignore_eos=True)
    alone = [engine_factory().generate([prompt], params)[0] for _ in range(2)]
    busy = engine_factory()
    for i, p in enumerate([SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=5, frequency_penalty=1.5),
                           SamplingParams(max_new_tokens=12, temperature=1.3, seed=5, logprobs=4)]):  # fmt: skip
        busy.add_request(tokens(5 + i, 20 + i), p)
    req = busy.add_request(prompt, params)[1]
    run(busy)
    assert alone[0] == alone[1] == req.output_token_ids


async def test_async_submit_group_streams_each_choice(engine_factory, tiny_model):
    """Guards against the asyncio path losing n > 1 or the constraint keyword."""
    prompt = tokens(9, 8)
    async with AsyncEngine(engine_factory()) as aengine:
        streams = aengine.submit_group(["x0", "x1"], prompt, SamplingParams(max_new_tokens=5, ignore_eos=True,
                                                                            logprobs=2))  # fmt: skip
        con = aengine.submit(prompt, SamplingParams(max_new_tokens=5, ignore_eos=True),
                             constraint=AllowOnly({3}, 256))  # fmt: skip

        async def collect(stream):
            return [ev async for ev in stream]

        results = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in [*streams, con])), 60)
    expected = hf_greedy(tiny_model, prompt, 5)
    assert [[e.token_id for e in r] for r in results[:2]] == [expected, expected]
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0][0] == e.token_id for e in results[0])
    assert [e.token_id for e in results[2]] == [3] * 5


# -- the real default model --------------------------------------------------------------------------


def real_engine(model, **overrides) -> Engine:
    base = dict(device="cpu", dtype="float32", max_batch=4, max_step_tokens=256, kv_block_size=16, kv_cache_tokens=2048)
    return Engine(model, EngineSettings(**{**base, **overrides}))


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


@pytest.mark.model
def test_frequency_penalty_on_the_real_model_matches_a_hand_computation(default_model):
    """Guards against penalties that are not OpenAI's (wrong sign, prompt tokens counted, counts
    not updated): each greedy token equals the argmax of HF's logits minus the penalties computed
    by hand from the output so far, and a strong penalty removes the repetition."""
    model, tokenizer = default_model
    prompt = encode_prompt(tokenizer, "Say the word 'yes' twenty times, separated by spaces.")
    plain = real_engine(model).generate([prompt], SamplingParams(max_new_tokens=20, ignore_eos=True))[0]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, frequency_penalty=2.0, presence_penalty=1.0)
    out = real_engine(model).generate([prompt], params)[0]
    for t, token in enumerate(out):
        logits = hf_logits(model, prompt + out[:t])
        counts = torch.bincount(torch.tensor(out[:t], dtype=torch.long), minlength=logits.shape[0]).float()
        assert int((logits - 2.0 * counts - 1.0 * (counts > 0)).argmax()) == token, t
    most_repeated = max(Counter(plain).values())
    assert most_repeated > 2  # the model does repeat itself unpenalised
    assert max(Counter(out).values()) < most_repeated and len(set(out)) > len(set(plain))


@pytest.mark.model
def test_logprobs_equal_log_softmax_of_a_reference_forward(default_model):
    """Guards against logprobs from the wrong position, the wrong normalisation, or after the
    penalty: greedy tokens' logprobs and top-5 equal log_softmax of HF's own forward."""
    model, tokenizer = default_model
    prompt = encode_prompt(tokenizer, "What is the capital of France?")
    engine = real_engine(model)
    req = engine.add_request(prompt, SamplingParams(max_new_tokens=8, logprobs=5, presence_penalty=0.5))[1]
    events = [e for e in run(engine) if e.request_id == req.request_id]
    assert len(events) == len(req.output_token_ids) > 0
    for t, ev in enumerate(events):
        ref = torch.log_softmax(hf_logits(model, prompt + req.output_token_ids[:t]), -1)
        assert ev.logprob == pytest.approx(ref[ev.token_id].item(), abs=1e-4)
        assert [i for i, _ in ev.top_logprobs] == ref.topk(5).indices.tolist()
        assert all(v == pytest.approx(ref[i].item(), abs=1e-4) for i, v in ev.top_logprobs)
    assert sum(torch.tensor([v for _, v in events[0].top_logprobs]).exp()) <= 1.0 + 1e-5


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                   "colors": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]},
                              "maxItems": 3}},  # bounded: sampled, the small model would write to the length limit
    "required": ["name", "age", "colors"],
    "additionalProperties": False,
}  # fmt: skip


def valid_for_schema(value) -> bool:
    """SCHEMA checked by hand (no jsonschema dependency)."""
    return (isinstance(value, dict) and set(value) == {"name", "age", "colors"} and isinstance(value["name"], str) and len(value["name"]) <= 24
            and isinstance(value["age"], int) and not isinstance(value["age"], bool)
            and isinstance(value["colors"], list) and len(value["colors"]) <= 3 and all(c in ("red", "green", "blue") for c in value["colors"]))  # fmt: skip


@pytest.fixture(scope="module")
def json_grammar(default_model):
    import xgrammar as xgr
    model, tokenizer = default_model
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model.config.vocab_size)
    compiler = xgr.GrammarCompiler(info)
    stop = sorted(eos_token_ids(model))  # the chat's end (<|im_end|>), not the tokenizer's eos_token

    def matcher():
        return xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA)), override_stop_tokens=stop)

    return matcher


@pytest.mark.model
def test_constraint_makes_the_real_model_emit_json_valid_for_a_schema(default_model, json_grammar):
    """Guards against a mask that is not applied (the small model answers in prose), applied to
    the wrong row, or a request not ending when the JSON is complete: greedy and sampled answers,
    in one batch with an unconstrained request, all parse and fit the schema."""
    model, tokenizer = default_model
    engine = real_engine(model)
    asks = ["Tell me about a cat.", "Describe your favourite person.", "What is the weather like?"]
    reqs = []
    for i, ask in enumerate(asks):
        p = SamplingParams(max_new_tokens=80) if i == 0 else SamplingParams(max_new_tokens=80, temperature=1.0, seed=i)
        reqs.append(engine.add_request(encode_prompt(tokenizer, ask), p, constraint=json_grammar())[1])
    free_prompt = encode_prompt(tokenizer, "Tell me about a cat.")
    free = engine.add_request(free_prompt, SamplingParams(max_new_tokens=16))[1]
    run(engine)
    for r in reqs:
        assert r.finish_reason is FinishReason.STOP, tokenizer.decode(r.output_token_ids)
        text = tokenizer.decode(r.output_token_ids, skip_special_tokens=True)
        assert valid_for_schema(json.loads(text)), text
    eos = model.generation_config.eos_token_id
    assert free.output_token_ids == hf_greedy(model, free_prompt, 16, eos=eos)  # unmasked


@pytest.mark.model
def test_a_preempted_constrained_request_keeps_its_matcher_in_step(default_model, json_grammar):
    """Guards against a readmitted request feeding its recomputed tokens to the matcher again
    (the matcher would refuse them or drift): preempted, it gives the same valid JSON as alone,
    and the matcher saw each output token exactly once."""
    model, tokenizer = default_model
    prompt = encode_prompt(tokenizer, "Describe a friend as JSON.")
    params = SamplingParams(max_new_tokens=60)

    class Recording:
        def __init__(self, inner):
            self.inner, self.accepted = inner, []

        def fill_next_token_bitmask(self, bitmask, index):
            return self.inner.fill_next_token_bitmask(bitmask, index)

        def accept_token(self, token_id):
            self.accepted.append(token_id)
            return self.inner.accept_token(token_id)

        def is_terminated(self):
            return self.inner.is_terminated()

    ref_engine = real_engine(model)
    ref = ref_engine.add_request(prompt, params, constraint=json_grammar())[1]
    run(ref_engine)
    tight = real_engine(model, kv_cache_tokens=192, max_batch=3, max_seq_len=192, kv_block_size=16)
    others = [tight.add_request(encode_prompt(tokenizer, q), SamplingParams(max_new_tokens=60, ignore_eos=True))[1]
              for q in ("Count to fifty.", "Name many animals.")]  # fmt: skip
    recording = Recording(json_grammar())
    req = tight.add_request(prompt, params, constraint=recording)[1]  # admitted last: the first victim
    run(tight)
    assert req.num_preemptions > 0 and all(o.is_finished for o in others)
    assert req.output_token_ids == ref.output_token_ids and recording.accepted == req.output_token_ids
    assert valid_for_schema(json.loads(tokenizer.decode(req.output_token_ids, skip_special_tokens=True)))
