"""``bench/engine.py --multi-turn``: what prefix caching and lazy KV allocation buy, each measured
against its baseline in the same run (imported by ``bench/engine.py``; not run on its own).

1. Multi-turn TTFT. A chat conversation of 8 turns resends its whole history every turn (system
   prompt, every user message and answer so far, the new message). With the prefix cache the last
   turn computes only its new message; without it, the whole history (~2k tokens in the full run,
   ~1k in ``--quick``). Both sides run the same last-turn prompt alone on an idle engine; their
   greedy outputs must be equal (the cache is exact). Two conversations of the same shape, best
   of each side.
2. Throughput at a fixed KV budget when callers ask for 4x the tokens they use (``max_new_tokens``
   = 4 x the length at which each answer ends, as when a model stops at EOS long before the cap):
   lazy allocation + preemption vs worst-case reservation (prompt + max_new_tokens at admission).
   Random prompts, prefix cache off on both sides, so only the allocation policy differs.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass

from inference.engine.engine import Engine
from inference.engine.request import SamplingParams
from inference.engine.settings import EngineSettings


class EndAfter:
    """Ends a request after ``n`` tokens through the engine's text-stream hook (in the step that
    produces token ``n``), like a model that emits EOS there while the caller asked for more."""

    def __init__(self, n: int) -> None:
        self.n, self.count, self.stopped = n, 0, False

    def push(self, token_id: int) -> str:
        self.count += 1
        self.stopped = self.count >= self.n
        return ""

    def finish(self) -> str:
        return ""


@dataclass
class TurnResult:
    history_tokens: int
    ttft_s: float
    output: list[int]


def _engine(model, args, **overrides):
    base = dict(device=args.device, max_batch=16, max_seq_len=4096, kv_cache_tokens=8192, max_step_tokens=512)
    return Engine(model, EngineSettings(**{**base, **overrides}))


def _run_alone(engine, prompt: list[int], max_new: int) -> TurnResult:
    _, req = engine.add_request(prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True))
    while engine.has_work():
        engine.step()
    return TurnResult(len(prompt), req.timings.ttft, list(req.output_token_ids))


def multi_turn_ttft(model, args) -> float:
    """Best (lowest) last-turn TTFT of each side over ``conversations`` conversations of the same
    shape: one TTFT is a single short measurement, which a busy neighbour can double."""
    turns, system_len, user_median, answer_len = (8, 64, 110, 12) if args.quick else (8, 128, 220, 32)
    conversations = 2
    rng = random.Random(args.seed)
    vocab = model.config.vocab_size
    draw = lambda n: [rng.randrange(10, vocab) for _ in range(n)]
    user_lens = [max(8, int(rng.gauss(user_median, user_median / 5))) for _ in range(turns)]
    cached, plain = _engine(model, args), _engine(model, args, prefix_caching=False)
    for e in (cached, plain):
        _run_alone(e, draw(24), 2)  # warm-up
    best_on = best_off = float("inf")
    for c in range(conversations):
        history, per_turn = draw(system_len), []
        for n in user_lens:
            history += draw(n)
            r = _run_alone(cached, list(history), answer_len)
            per_turn.append(r)
            history += r.output
        last_prompt = history[: per_turn[-1].history_tokens]
        without = _run_alone(plain, last_prompt, answer_len)
        if without.output != per_turn[-1].output:
            raise AssertionError("prefix cache changed the greedy output of the last turn")
        print(f"conversation {c + 1}: TTFT per turn with the prefix cache (s): "
              + " ".join(f"{r.ttft_s:.2f}" for r in per_turn)
              + f"; last turn ({per_turn[-1].history_tokens} tokens of history) without: {without.ttft_s:.2f}")  # fmt: skip
        best_on, best_off = min(best_on, per_turn[-1].ttft_s), min(best_off, without.ttft_s)
    print(f"multi-turn last turn ({turns} turns, {per_turn[-1].history_tokens} tokens of history, best of "
          f"{conversations} conversations): TTFT with prefix cache {best_on:.3f} s, without {best_off:.3f} s; "
          f"cache hit tokens {cached.stats().prefix_cache_hit_tokens}")  # fmt: skip
    return best_off / best_on


def preemption_throughput(model, args) -> float:
    # Chat-like: answers longer than the new message; prompts would cost both sides the same prefill.
    n, prompt_median, used_median, kv = (16, 24, 48, 1024) if args.quick else (32, 32, 64, 1536)
    rng = random.Random(args.seed + 1)
    vocab = model.config.vocab_size
    draw = lambda median, hi: max(4, min(hi, int(rng.lognormvariate(math.log(median), 0.9))))
    work = [([rng.randrange(10, vocab) for _ in range(draw(prompt_median, 4 * prompt_median))], draw(used_median, 2 * used_median))
            for _ in range(n)]  # fmt: skip
    results: dict[str, float] = {}
    # Alternating repeats (--repeats), best of each: a noisy neighbour then hurts both sides alike.
    for mode in ("reserve", "lazy") * (args.repeats or 1):
        engine = _engine(model, args, kv_cache_tokens=kv, max_seq_len=kv, prefix_caching=False, kv_allocation=mode,
                         max_waiting=n)  # fmt: skip
        _run_alone(engine, work[0][0][:8], 2)  # warm-up
        t0, steps, batch = time.monotonic(), 0, []
        reqs = [engine.add_request(prompt, SamplingParams(max_new_tokens=4 * used, ignore_eos=True),
                                   text_stream=EndAfter(used))[1] for prompt, used in work]
        while engine.has_work():
            engine.step()
            steps += 1
            batch.append(engine.scheduler.num_running)
        seconds = time.monotonic() - t0
        if [len(r.output_token_ids) for r in reqs] != [u for _, u in work]:
            raise AssertionError(f"{mode}: a request did not produce exactly its tokens")
        tokens = sum(u for _, u in work)
        results[mode] = max(results.get(mode, 0.0), tokens / seconds)
        print(f"kv={mode:8} budget {kv} tokens: {tokens / seconds:7.1f} tokens/s, {seconds:6.1f} s, mean running "
              f"{statistics.mean(batch):5.2f}, preemptions {engine.stats().preemptions}")  # fmt: skip
    ratio = results["lazy"] / results["reserve"]
    print(f"engine/kv_lazy_vs_reserve tokens/s ratio = {ratio:.2f} (callers ask for 4x the tokens they use)")
    return ratio


def run(model, args) -> None:
    preemption_throughput(model, args)
    ratio = multi_turn_ttft(model, args)
    print(f"engine/prefix_cache last-turn TTFT ratio = {ratio:.1f}")
