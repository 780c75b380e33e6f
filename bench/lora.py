"""Many LoRA adapters in one batch: what a step of mixed adapters costs against the base model alone.

The engine applies each row's adapter inside the shared step (``inference/engine/lora_bank.py``: the
resident adapters' factors stacked, a per-row column mask). Measured on the default model, greedy,
float32, on the same prompts and output lengths (``ignore_eos``) in every run:

* **base**: every request on the base model, one batch;
* **mixed**: the same requests, request i with adapter i mod (A + 1) (A adapters and the base model),
  one batch, every adapter already in memory;
* **one at a time**: each adapter's requests (and the base model's) as a batch of their own, one
  after the other: what serving adapters by swapping (or merging) them between batches gives;
* **first request after a load**: the time to first token of a request naming an adapter that is
  registered but not in memory (read from disk beside the step loop), against the same request once
  it is.

The adapters are peft's, of the shape ``chatpipe train lora`` trains (rank 16, alpha 32, on every
projection), with random factors: speed does not depend on what they learned. ``--strategy grouped``
runs the mixed batch with the alternative the bank's docstring weighs (rows grouped per adapter:
index_select, two GEMMs, index_add per adapter and projection group) instead of the masked form.

    python bench/lora.py --quick     # last line: mixed / base tokens/s ratio
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from inference.engine.settings import EngineSettings

TOPICS = ["Kafka partitions", "consumer groups", "exactly-once delivery", "compacted topics", "producer batching",
          "offset commits", "rebalances", "dead-letter queues", "backpressure", "prefix caches"]


def engine_for(model, args):
    from inference.engine.engine import Engine

    return Engine(model, EngineSettings(
        device="cpu", dtype="float32", max_batch=args.requests, max_step_tokens=512, kv_cache_tokens=16384,
        num_threads=args.threads, max_loras=args.adapters + 1, prefix_caching=False,
    ))  # fmt: skip


def timed_batch(engine, jobs, new_tokens: int) -> tuple[int, float]:
    """Run ``jobs`` ((prompt, adapter)) as one batch; returns (tokens generated, seconds)."""
    from inference.engine.request import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    started = time.perf_counter()
    reqs = [engine.add_request(p, params, adapter=a)[1] for p, a in jobs]
    while engine.has_work():
        engine.step()
    elapsed = time.perf_counter() - started
    errors = [r.error for r in reqs if r.error]
    if errors:
        raise SystemExit(f"a request failed: {errors[0]}")
    return sum(len(r.output_token_ids) for r in reqs), elapsed


def first_token_s(engine, prompt, adapter) -> float:
    from inference.engine.request import SamplingParams

    started = time.perf_counter()
    req = engine.add_request(prompt, SamplingParams(max_new_tokens=2, ignore_eos=True), adapter=adapter)[1]
    while not req.output_token_ids:
        engine.step()
    ttft = time.perf_counter() - started
    while engine.has_work():
        engine.step()
    return ttft


def use_grouped_strategy() -> None:
    """Replace the bank's masked form by rows grouped per adapter (the measured alternative)."""
    from inference.engine import lora_bank

    groups_of_mask: dict[int, list] = {}

    def rows_by_slot(bank, mask):
        key = id(mask)
        if key not in groups_of_mask:
            groups_of_mask.clear()
            slot_of_row = torch.where(mask.any(1), mask.argmax(1) // bank.rank, -1)
            groups_of_mask[key] = [(s, (slot_of_row == s).nonzero()[:, 0]) for s in slot_of_row.unique().tolist()
                                   if s >= 0]  # fmt: skip
        return groups_of_mask[key]

    def grouped_add_(self, layer, group, x, outs, mask):
        g = self.layers[layer].get(group)
        if g is None:
            return
        r, s_all = self.rank, self.num_slots
        a_all = g.a_t.view(-1, len(g.present), s_all, r)
        for slot, rows in rows_by_slot(self, mask):
            xa = x.index_select(0, rows) @ a_all[:, :, slot].reshape(-1, len(g.present) * r)  # [n, P * r]
            for j, i in enumerate(g.present):
                outs[i].index_add_(0, rows, xa[:, j * r : (j + 1) * r] @ g.b_t[j][slot * r : (slot + 1) * r])

    lora_bank.LoraBank.add_ = grouped_add_


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 requests x 24 tokens (about a minute on 2 cores)")
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--requests", type=int, help="requests per batch (the batch size)")
    ap.add_argument("--new-tokens", type=int, help="output tokens per request")
    ap.add_argument("--repeats", type=int, help="timed runs of each measurement (the best is kept)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--strategy", choices=["masked", "grouped"], default="masked")
    args = ap.parse_args()
    quick = dict(requests=10, new_tokens=24, repeats=1)
    full = dict(requests=20, new_tokens=64, repeats=3)
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.strategy == "grouped":
        use_grouped_strategy()

    from chatpipe.testing.lora_adapters import make_adapter
    from formats.chat_tokens import encode_chat
    from inference.engine.model_store import load_model, pull_default_model

    settings = EngineSettings(device="cpu", dtype="float32")
    pull_default_model(settings)
    model, tokenizer = load_model(settings)
    torch.set_num_threads(args.threads)
    folder = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    names = [f"adapter-{i}" for i in range(args.adapters)]
    for i, name in enumerate(names + ["cold"]):
        make_adapter(model, folder / name, seed=i, r=16, alpha=32, b_scale=0.05)
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": f"Explain {TOPICS[i % len(TOPICS)]} briefly."}])
               for i in range(args.requests)]  # fmt: skip
    choices = [*names, None]
    mixed_jobs = [(p, choices[i % len(choices)]) for i, p in enumerate(prompts)]
    print(f"workload: {args.requests} requests in one batch, {args.new_tokens} output tokens each, "
          f"{args.adapters} adapters (rank 16, every projection) + the base model, {args.threads} threads, "
          f"strategy {args.strategy}; best of {args.repeats}")

    engine = engine_for(model, args)
    for name in names + ["cold"]:
        engine.register_adapter(name, folder / name)
    timed_batch(engine, [(prompts[0], n) for n in names], 2)  # loads every adapter, warms the kernels

    def best(jobs_list) -> float:
        rates = []
        for _ in range(args.repeats):
            tokens, seconds = 0, 0.0
            for jobs in jobs_list:
                n, s = timed_batch(engine, jobs, args.new_tokens)
                tokens, seconds = tokens + n, seconds + s
            rates.append(tokens / seconds)
        return max(rates)

    base = best([[(p, None) for p in prompts]])
    mixed = best([mixed_jobs])
    apart = best([[job for job in mixed_jobs if job[1] == c] for c in choices])
    warm = min(first_token_s(engine, prompts[0], names[0]) for _ in range(2))
    cold = first_token_s(engine, prompts[0], "cold")  # registered, not in memory: loaded on this request
    load_s = engine.adapter_stats().last_load_s
    print(f"base only          {base:7.1f} tokens/s")
    print(f"mixed in one batch {mixed:7.1f} tokens/s  ({mixed / base:.2f}x base)")
    print(f"one at a time      {apart:7.1f} tokens/s  ({apart / base:.2f}x base; mixed is {mixed / apart:.2f}x this)")
    print(f"first token: adapter in memory {warm * 1000:.0f} ms, after a load {cold * 1000:.0f} ms "
          f"(the load itself {load_s * 1000:.0f} ms)")
    print(f"lora mixed/base tokens/s ratio = {mixed / base:.2f}")


if __name__ == "__main__":
    main()
