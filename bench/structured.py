"""Structured outputs: engine tokens/s with a JSON schema vs without, same requests.

The real default model (SmolLM2-135M-Instruct, ``chatpipe model pull``), N chat prompts at once,
greedy, continuous batching. The constrained run (``json_schema``: nested object, array, enum,
integer, strings, required fields; ``GrammarCompiler.matcher(fmt, max_tokens)``) ends each request
on its stop token; the unconstrained run then asks each request for exactly the number of tokens
its constrained twin produced, with EOS ignored, so both runs generate the same token counts and
tokens/s compare the per-token cost only (mask fill on the CPU + apply + accept). The prefix cache
is off so that the second run does not reuse the first's prompts. Sides alternate ``--repeats``
times; the median of each is kept. The grammar is compiled once before timing (the LRU: a schema
seen before costs no compile).

On CUDA the sampler fills the masks on the host while the queued forward runs (the fill overlaps
it); on CPU the fill is serial, so a CPU run measures the full per-token cost of the grammar. See
docs/engine.md, "Structured outputs".

    python bench/structured.py --quick      # about a minute on 2 CPU cores
    python bench/structured.py              # more requests and repeats

Last line: ``structured/json_schema tokens/s ratio = X.XX`` (goal >= 0.9).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "role", "tags", "address"],
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
SUBJECTS = ["a software engineer from Paris", "a dog named Rex", "a retired pilot in Tokyo", "a chef who hates salt",
            "a student in Lagos", "a wizard aged 900", "a famous violinist", "a guest at a wedding",
            "an admin called Root", "a cat that owns three houses", "a nurse in Lima", "a farmer in Kent",
            "a poet from Kyoto", "a racing driver", "a librarian", "a deep-sea diver"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="about a minute on 2 CPU cores")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-requests", type=int)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    n = args.num_requests or (8 if args.quick else 16)
    repeats = args.repeats or (2 if args.quick else 3)
    torch.set_num_threads(args.threads)

    from formats.chat_tokens import encode_chat
    from inference.engine.engine import Engine
    from inference.engine.grammar import GrammarCompiler
    from inference.engine.model_store import load_model
    from inference.engine.request import FinishReason, SamplingParams
    from inference.engine.settings import EngineSettings

    settings = EngineSettings(device=args.device, dtype="float32", kv_cache_tokens=8192, max_batch=n,
                              max_step_tokens=1024, prefix_caching=False)
    model, tokenizer = load_model(settings)
    engine = Engine(model, settings)
    compiler = GrammarCompiler(tokenizer, engine.vocab_size, sorted(engine.eos_token_ids))
    compiler.compile(FORMAT)  # warm the LRU: the bench measures decoding, not compiling
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": f"Describe {SUBJECTS[i % len(SUBJECTS)]}."}])
               for i in range(n)]

    def run(lengths: list[int] | None) -> tuple[float, list[int]]:
        reqs = []
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            if lengths is None:
                params = SamplingParams(max_new_tokens=args.max_tokens, temperature=0.0)
                constraint = compiler.matcher(FORMAT, max_tokens=args.max_tokens)
            else:
                params = SamplingParams(max_new_tokens=lengths[i], temperature=0.0, ignore_eos=True)
                constraint = None
            reqs.append(engine.add_request(p, params, constraint=constraint)[1])
        while engine.has_work():
            engine.step()
        elapsed = time.perf_counter() - t0
        if lengths is None:
            assert all(r.finish_reason is FinishReason.STOP for r in reqs), [r.finish_reason for r in reqs]
        out = [len(r.output_token_ids) for r in reqs]
        return sum(out) / elapsed, out

    _, lengths = run(None)  # warm-up, and the lengths both sides produce
    free_run, _ = run(lengths)  # warm-up of the unconstrained path
    structured, free = [], []
    for _ in range(repeats):
        tps, got = run(None)
        assert got == lengths, "greedy constrained outputs changed between runs"
        structured.append(tps)
        tps, got = run(lengths)
        assert got == lengths
        free.append(tps)
    s, f = statistics.median(structured), statistics.median(free)
    print(f"{n} requests, {sum(lengths)} tokens per run (mean {sum(lengths) / n:.0f}), greedy, "
          f"{args.device}, {args.threads} threads, median of {repeats}")
    print(f"json_schema:   {s:8.1f} tokens/s  (runs: {', '.join(f'{x:.1f}' for x in structured)})")
    print(f"unconstrained: {f:8.1f} tokens/s  (runs: {', '.join(f'{x:.1f}' for x in free)})")
    print(f"structured/json_schema tokens/s ratio = {s / f:.2f}")


if __name__ == "__main__":
    main()
