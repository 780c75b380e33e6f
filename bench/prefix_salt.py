"""Prefix-cache hit rate within each tenant, salted vs unsalted engine (issue 19, point 4).

The salt gives each tenant its own hash root, so a block computed for one tenant never serves
another. What it must not cost is reuse *within* a tenant. Workload (the same for both sides,
seeded): several tenants, each with a few multi-turn conversations (every turn resends the
history as chat text, through the model's chat template); half the conversations carry the
tenant's own system prompt, half none, so the template's default system block is a prefix
common to every tenant (what an unsalted cache shares across tenants). Each round submits the
next turn of every conversation at once and steps the engine until all are answered (greedy,
short answers; arrivals a few steps apart, ``--stagger``), so the tenants' requests share the
cache and compete for it.

Counted per request at admission: prompt tokens, tokens taken from the cache, and of those the
ones from blocks that no request of the same tenant had computed or reused before ("cross
tenant", always 0 when salted). Within-tenant hit rate = (hits - cross-tenant hits) / prompt
tokens. Headline: within-tenant hit rate salted / unsalted (1.00 = the salt costs nothing
inside a tenant). The answers of both sides must be equal (the run fails otherwise).

    python bench/prefix_salt.py --quick     # last line: the headline ratio
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.engine.settings import EngineSettings

QUESTIONS = [
    "What is a Kafka partition?", "How do consumer groups share work?", "Explain exactly-once delivery briefly.",
    "What does a compacted topic keep?", "Why would a producer batch records?", "What is an offset commit?",
    "How does a rebalance work?", "What is a dead-letter queue for?", "Name one use of a tail consumer.",
    "What is backpressure?", "How is a prefix cache useful for chat?", "What is time to first token?",
]


@dataclass
class Conversation:
    tenant: str
    user: str
    messages: list[dict] = field(default_factory=list)


@dataclass
class Tally:
    prompt: int = 0
    hits: int = 0
    cross: int = 0

    @property
    def within_rate(self) -> float:
        return (self.hits - self.cross) / self.prompt if self.prompt else 0.0


def make_conversations(tenants: int, per_tenant: int, seed: int) -> list[Conversation]:
    rng = random.Random(seed)
    convs = []
    for t in range(tenants):
        system = f"You are the support assistant of tenant {t}. " + " ".join(rng.sample(QUESTIONS, 3))
        for c in range(per_tenant):
            conv = Conversation(tenant=f"tenant-{t}", user=f"user-{c % 2}")
            if c % 2 == 0:
                conv.messages.append({"role": "system", "content": system})
            convs.append(conv)
    return convs


def run(model, tokenizer, args, salted: bool) -> tuple[dict[str, Tally], list[list[int]], int, float]:
    from formats.chat_tokens import encode_chat
    from inference.engine.engine import Engine
    from inference.engine.request import SamplingParams

    engine = Engine(model, EngineSettings(device="cpu", dtype="float32", max_batch=args.batch, max_seq_len=2048,
                                          kv_cache_tokens=args.kv_cache_tokens, prefix_cache_salt=salted))
    rng = random.Random(args.seed + 1)
    convs = make_conversations(args.tenants, args.conversations, args.seed)
    params = SamplingParams(max_new_tokens=args.answer_tokens, ignore_eos=True)
    tallies: dict[str, Tally] = defaultdict(Tally)
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for _ in range(args.turns):
        reqs = []
        for conv in convs:
            conv.messages.append({"role": "user", "content": rng.choice(QUESTIONS)})
            ids = encode_chat(tokenizer, conv.messages)
            _, req = engine.add_request(ids, params, tenant=conv.tenant, user_id=conv.user)
            reqs.append((conv, req))
            for _ in range(args.stagger):  # arrivals spread out, as from many clients
                if engine.has_work():
                    engine.step()
        while engine.has_work():
            engine.step()
        for conv, req in reqs:
            tally = tallies[conv.tenant]
            tally.prompt += len(req.prompt_token_ids)
            tally.hits += req.num_cached_tokens
            tally.cross += req.num_cross_tenant_cached_tokens
            outputs.append(list(req.output_token_ids))
            conv.messages.append({"role": "assistant", "content": tokenizer.decode(req.output_token_ids,
                                                                                   skip_special_tokens=True)})
    return dict(tallies), outputs, engine.stats().preemptions, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 tenants x 2 conversations x 3 turns (~1 min on 2 cores)")
    ap.add_argument("--tenants", type=int)
    ap.add_argument("--conversations", type=int, help="per tenant")
    ap.add_argument("--turns", type=int)
    ap.add_argument("--answer-tokens", type=int, default=12)
    ap.add_argument("--kv-cache-tokens", type=int, help="KV budget (smaller: eviction pressure)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--stagger", type=int, default=3, help="engine steps between two arrivals of a round")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    quick = dict(tenants=3, conversations=2, turns=3, kv_cache_tokens=4096)
    full = dict(tenants=4, conversations=4, turns=5, kv_cache_tokens=8192)
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)

    import torch

    from inference.engine.model_store import load_model

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(EngineSettings(device="cpu", dtype="float32"))
    (salted_t, salted_out, salted_pre, salted_s), (plain_t, plain_out, plain_pre, plain_s) = (
        run(model, tokenizer, args, salted) for salted in (True, False))
    if salted_out != plain_out:
        raise SystemExit("the salted and unsalted engines answered differently: the cache is not exact")

    print(f"workload: {args.tenants} tenants x {args.conversations} conversations x {args.turns} turns, "
          f"{args.answer_tokens}-token answers, KV {args.kv_cache_tokens} tokens, batch {args.batch}, "
          f"SmolLM2-135M fp32 CPU, {args.threads} thread(s)")
    print(f"{'tenant':<10} {'prompt':>7} | {'salted hits':>11} {'within':>7} | {'unsalted hits':>13} "
          f"{'cross':>6} {'within':>7}")
    for tenant in sorted(salted_t):
        s, p = salted_t[tenant], plain_t[tenant]
        print(f"{tenant:<10} {s.prompt:>7} | {s.hits:>11} {s.within_rate:>7.3f} | {p.hits:>13} {p.cross:>6} "
              f"{p.within_rate:>7.3f}")
    total = lambda ts: Tally(sum(t.prompt for t in ts.values()), sum(t.hits for t in ts.values()),
                             sum(t.cross for t in ts.values()))
    s, p = total(salted_t), total(plain_t)
    assert s.cross == 0, "a salted engine served a block across tenants"
    print(f"{'all':<10} {s.prompt:>7} | {s.hits:>11} {s.within_rate:>7.3f} | {p.hits:>13} {p.cross:>6} "
          f"{p.within_rate:>7.3f}")
    print(f"cross-tenant hit tokens: unsalted {p.cross} ({p.cross / p.prompt:.3f} of prompt tokens), salted "
          f"{s.cross}; preemptions {salted_pre} / {plain_pre}; wall {salted_s:.1f} s / {plain_s:.1f} s")
    per_tenant = [salted_t[t].within_rate / plain_t[t].within_rate for t in salted_t if plain_t[t].within_rate]
    print(f"per-tenant ratios: min {min(per_tenant):.3f}, max {max(per_tenant):.3f}")
    print(f"prefix_salt hit-rate ratio (salted/unsalted within tenant) = {s.within_rate / p.within_rate:.2f}")


if __name__ == "__main__":
    main()
