"""Engine vs Hugging Face ``generate``: offline throughput and latency on a ShareGPT-like workload.

N requests arrive at once; prompt and output lengths are drawn from seeded log-normal
distributions (ShareGPT-like: long-tailed, clipped to the context), prompts are random token ids.
Both sides produce exactly each request's target output length (EOS ignored), greedy:

  * engine: continuous batching, ``max_batch`` = the batch size;
  * baseline: ``model.generate`` in static batches of the same size, left-padded, with
    ``max_new_tokens`` = the longest target in the batch (how static batching wastes work).

Only useful tokens (each request's target) count for both. Prints tokens/s, TTFT and TPOT
percentiles, and, as the last line, the ratio. ``--model-config llama-1b|llama-8b`` builds a
randomly initialised Llama of that shape (no weights can be fetched on the GPU machine).

``--shapes llama-1b,llama-8b`` runs that comparison for each random-init shape in turn and adds
batch-1 decode bandwidth: (bytes of weights + KV read per token) / time per token, also as a
share of the device's peak memory bandwidth (``--peak-gbs``; H200: 4800 GB/s). ``--multi-turn``
measures the prefix cache (last-turn TTFT of 8-turn conversations) and lazy allocation with
preemption (throughput at a fixed KV budget), see ``bench/engine_multiturn.py``.

    python bench/engine.py --quick            # about a minute on 2 CPU cores
    python bench/engine.py                    # the docs/benchmarks.md figures
    python bench/engine.py --multi-turn [--quick]
    python bench/engine.py --device cuda --shapes llama-1b,llama-8b     # the GPU command (< 8 min, H200)
    python bench/engine.py --device cpu --shapes tiny                   # CPU smoke run of the same path
    python bench/engine.py --engine vllm [--quick]                      # vLLM's engine vs HF generate

vLLM's engine is the second baseline (issue 45): where its environment is made (`make setup-vllm`,
infra/vllm_env.py), the default run also runs vLLM's engine (the same ``VllmEngine`` the worker drives:
``LLMEngine`` in process, eager, fp32 on CPU) on the same workload, with the same threads, batch and
context, in a child process of that environment (vLLM pins its own torch), and the last line is then
``engine/vllm tokens/s ratio``. ``--engine vllm`` runs vLLM's engine against HF generate in that
environment instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from inference.engine.engine import Engine
from inference.engine.model_store import load_model
from inference.engine.request import SamplingParams
from inference.engine.settings import EngineSettings

# Llama shapes of random-init models (RoPE theta 5e5); "tiny" is the CPU smoke test of the same path.
LLAMA3 = dict(num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
MODEL_CONFIGS = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, tie_word_embeddings=True, **LLAMA3),  # 3.2 1B
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, tie_word_embeddings=False, **LLAMA3),  # 3.1 8B
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, tie_word_embeddings=False,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=2048),  # fmt: skip
}


@dataclass
class Workload:
    prompts: list[list[int]]
    outputs: list[int]  # target output length per request


@dataclass
class Result:
    seconds: float
    useful_tokens: int
    ttft: list[float]
    tpot: list[float]

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.seconds


def make_workload(n: int, vocab: int, seed: int, prompt_median: int, output_median: int, max_prompt: int, max_output: int) -> Workload:
    rng = random.Random(seed)
    draw = lambda median, hi: max(4, min(hi, int(rng.lognormvariate(math.log(median), 0.9))))
    prompts, outputs = [], []
    for _ in range(n):
        prompts.append([rng.randrange(10, vocab) for _ in range(draw(prompt_median, max_prompt))])
        outputs.append(draw(output_median, max_output))
    return Workload(prompts, outputs)


def load(args: argparse.Namespace):
    dtype = {"auto": torch.bfloat16 if args.device.startswith("cuda") else torch.float32}.get(args.dtype) or getattr(torch, args.dtype)
    if args.model_config:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(max_position_embeddings=8192, rope_theta=500000.0, **MODEL_CONFIGS[args.model_config])
        torch.manual_seed(0)
        with torch.device(args.device):
            model = LlamaForCausalLM._from_config(cfg, dtype=dtype)
        return model.eval(), f"random-init {args.model_config}"
    model, _ = load_model(EngineSettings(device=args.device, dtype=args.dtype))
    return model.to(dtype), "SmolLM2-135M-Instruct"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def step_budget(wl: Workload, args: argparse.Namespace) -> int:
    """Tokens per step for both engines: ``--max-step-tokens``, raised to the longest request, as
    ``VllmEngine`` raises vLLM's ``max_num_batched_tokens`` (so neither engine gets the bigger budget:
    on the full workload, 768 vs 512 tokens per step was worth ~7% to ours)."""
    return max(args.max_step_tokens, max(len(p) for p in wl.prompts) + max(wl.outputs))


def vllm_settings(wl: Workload, args: argparse.Namespace) -> EngineSettings:
    max_len = max(len(p) for p in wl.prompts) + max(wl.outputs)
    return EngineSettings(device=args.device, dtype=args.dtype, max_batch=args.batch_size, max_seq_len=max_len,
                          max_waiting=len(wl.prompts), kv_cache_tokens=args.batch_size * max_len,
                          max_step_tokens=step_budget(wl, args))


def run_vllm(wl: Workload, args: argparse.Namespace) -> Result:
    """vLLM's engine (``inference.vllm_engine.VllmEngine``) on the workload: all requests at once,
    stepped to the end as ``run_engine`` steps ours. Runs in the vLLM environment only."""
    from inference.vllm_engine.engine import VllmEngine

    settings = vllm_settings(wl, args)
    engine = VllmEngine(settings.default_model_dir(), settings)
    warm = engine.add_request_group(1, wl.prompts[0][:8], SamplingParams(max_new_tokens=4, ignore_eos=True))[1]
    while engine.has_work():
        engine.step()
    assert len(warm[0].output_token_ids) == 4
    t0 = time.monotonic()
    reqs = [engine.add_request_group(1, p, SamplingParams(max_new_tokens=o, ignore_eos=True))[1][0]
            for p, o in zip(wl.prompts, wl.outputs)]
    while engine.has_work():
        engine.step()
    seconds = time.monotonic() - t0
    assert all(len(r.output_token_ids) == o for r, o in zip(reqs, wl.outputs))
    tpots = [r.timings.tpot(len(r.output_token_ids)) for r in reqs]
    engine.shutdown()
    return Result(seconds, sum(wl.outputs), [r.timings.ttft for r in reqs], [t for t in tpots if t is not None])


def vllm_baseline(args: argparse.Namespace) -> Result | None:
    """vLLM's engine on this run's workload, in a child process of the vLLM environment (None, with
    the reason printed, where that environment is not made)."""
    import json
    import subprocess

    from infra.process_env import outside_env
    from infra.vllm_env import process_env, vllm_env

    env = vllm_env()
    if not env.ready:
        print(f"vLLM baseline: not run, its environment is not made ({env.root}; `make setup-vllm`)")
        return None
    argv = [str(env.python), __file__, "--engine", "vllm", "--vllm-only", "--device", args.device, "--dtype",
            args.dtype, "--num-requests", str(args.num_requests), "--batch-size", str(args.batch_size),
            "--max-step-tokens", str(args.max_step_tokens), "--seed", str(args.seed), "--threads", str(args.threads),
            "--repeats", str(args.repeats)] + (["--quick"] if args.quick else [])
    done = subprocess.run(argv, capture_output=True, text=True, env=process_env(env, outside_env(os.environ), args.threads))
    line = next((x for x in done.stdout.splitlines() if x.startswith(RESULT_PREFIX)), None)
    if done.returncode != 0 or line is None:
        raise SystemExit(f"the vLLM baseline failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return Result(**json.loads(line.removeprefix(RESULT_PREFIX)))


RESULT_PREFIX = "VLLM_RESULT "


def run_engine(model, wl: Workload, args: argparse.Namespace) -> Result:
    max_len = max(len(p) for p in wl.prompts) + max(wl.outputs)
    settings = EngineSettings(
        device=args.device, max_batch=args.batch_size, max_seq_len=max_len, max_waiting=len(wl.prompts),
        kv_cache_tokens=args.batch_size * max_len, max_step_tokens=step_budget(wl, args), compile=args.compile,
    )  # fmt: skip
    engine = Engine(model, settings)
    engine.generate([wl.prompts[0][:8]], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    sync(args.device)
    t0 = time.monotonic()
    reqs = [engine.add_request(p, SamplingParams(max_new_tokens=o, ignore_eos=True))[1] for p, o in zip(wl.prompts, wl.outputs)]
    while engine.has_work():
        engine.step()
    sync(args.device)
    seconds = time.monotonic() - t0
    assert all(len(r.output_token_ids) == o for r, o in zip(reqs, wl.outputs))
    tpots = [r.timings.tpot(len(r.output_token_ids)) for r in reqs]
    return Result(seconds, sum(wl.outputs), [r.timings.ttft for r in reqs], [t for t in tpots if t is not None])


class StepTimes:
    """A ``generate`` streamer that records when each step's tokens appear (first put = prompt)."""

    def __init__(self, device: str) -> None:
        self.device, self.times = device, []

    def put(self, _value) -> None:
        sync(self.device)
        self.times.append(time.monotonic())

    def end(self) -> None:
        pass


def run_hf(model, wl: Workload, args: argparse.Namespace) -> Result:
    gen_cfg = model.generation_config.__class__.from_dict(model.generation_config.to_dict())
    gen_cfg.eos_token_id, gen_cfg.pad_token_id, gen_cfg.do_sample = None, 0, False  # no EOS: run to max_new

    def generate(batch: list[list[int]], max_new: int, streamer=None):
        gen_cfg.max_new_tokens = max_new
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=args.device)  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=args.device)
        with torch.inference_mode():
            return model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg,
                                  streamer=streamer)  # fmt: skip

    generate([wl.prompts[0][:8]], 4)  # warm-up
    sync(args.device)
    t0 = time.monotonic()
    ttft, tpot = [], []
    for i in range(0, len(wl.prompts), args.batch_size):
        batch, outs = wl.prompts[i : i + args.batch_size], wl.outputs[i : i + args.batch_size]
        st = StepTimes(args.device)
        generate(batch, max(outs), streamer=st)
        for o in outs:  # times[k] = when the k-th new token of every row appeared
            ttft.append(st.times[1] - t0)
            if o > 1:
                tpot.append((st.times[o] - st.times[1]) / (o - 1))
    sync(args.device)
    return Result(time.monotonic() - t0, sum(wl.outputs), ttft, tpot)


def decode_bandwidth(model, args: argparse.Namespace, prompt_len: int, new_tokens: int) -> tuple[float, float, float]:
    """Batch-1 decode: (seconds per token, bytes read per token, GB/s). Bytes per token = every
    weight once (the embedding table only as the LM head when tied; an untied one reads one row)
    + the K/V of the whole context, averaged over the decode."""
    cfg = model.config
    engine = Engine(model, EngineSettings(device=args.device, max_batch=1, max_seq_len=prompt_len + new_tokens + 16,
                                          kv_cache_tokens=prompt_len + new_tokens + 16, compile=args.compile))  # fmt: skip
    prompt = [random.Random(args.seed).randrange(10, cfg.vocab_size) for _ in range(prompt_len)]
    engine.generate([prompt[:8]], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    _, req = engine.add_request(prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    while engine.has_work():
        engine.step()
    tpot = req.timings.tpot(len(req.output_token_ids))
    elt = next(model.parameters()).element_size()
    weights = sum(p.numel() for p in model.parameters()) * elt
    if not cfg.tie_word_embeddings:
        weights -= (cfg.vocab_size - 1) * cfg.hidden_size * elt  # the input embedding reads one row
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * elt
    per_token = weights + kv_per_token * (prompt_len + new_tokens / 2)
    return tpot, per_token, per_token / tpot / 1e9


def run_shapes(args: argparse.Namespace) -> None:
    """Each random-init shape: engine vs HF generate, then batch-1 decode bandwidth."""
    gpu = args.device.startswith("cuda")
    peak = args.peak_gbs or (4800.0 if gpu else None)
    lines = []
    for shape in args.shapes.split(","):
        args.model_config = shape
        t0 = time.monotonic()
        model, name = load(args)
        n, bs, wl_shape, prompt_len, new = (
            (64, 32, dict(prompt_median=256, output_median=128, max_prompt=1024, max_output=512), 1024, 128) if gpu
            else (8, 4, dict(prompt_median=24, output_median=12, max_prompt=64, max_output=32), 64, 16))
        args.num_requests, args.batch_size = args.num_requests or n, args.batch_size or bs
        wl = make_workload(args.num_requests, model.config.vocab_size, args.seed, **wl_shape)
        eng, hf = run_engine(model, wl, args), run_hf(model, wl, args)
        tpot, per_token, gbs = decode_bandwidth(model, args, prompt_len, new)
        share = f", {100 * gbs / peak:.1f}% of {peak:.0f} GB/s" if peak else ""
        lines.append(f"{shape}: engine {eng.tokens_per_s:.1f} tok/s vs generate {hf.tokens_per_s:.1f} tok/s "
                     f"(ratio {eng.tokens_per_s / hf.tokens_per_s:.2f}; {args.num_requests} requests, batch {args.batch_size}); "
                     f"batch-1 decode {tpot * 1000:.2f} ms/token, {per_token / 1e9:.3f} GB/token -> {gbs:.0f} GB/s{share}")  # fmt: skip
        print(f"{name} {next(model.parameters()).dtype} on {args.device} ({time.monotonic() - t0:.0f} s): {lines[-1]}", flush=True)
        args.num_requests = args.batch_size = None
        del model
        torch.cuda.empty_cache()  # a no-op where CUDA was never initialised
    for line in lines:
        print(line)
    print(f"engine/hf_generate tokens/s ratio ({shape}) = {eng.tokens_per_s / hf.tokens_per_s:.2f}")


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else (xs[0] if xs else float("nan"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small workload, about a minute on 2 CPU cores")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--model-config", choices=sorted(MODEL_CONFIGS), help="random-init Llama of this shape")
    ap.add_argument("--num-requests", type=int)
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--max-step-tokens", type=int, default=512,
                    help="tokens per engine step, raised to the longest request for both engines (step_budget)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads; 1 by default: on a shared machine OpenMP threads spin while descheduled")
    ap.add_argument("--repeats", type=int, help="run each side this many times, alternating; keep the fastest")
    ap.add_argument("--compile", action="store_true", help="torch.compile the MLPs (engine side)")
    ap.add_argument("--multi-turn", action="store_true",
                    help="prefix cache TTFT on 8-turn conversations + lazy vs reserved KV throughput")  # fmt: skip
    ap.add_argument("--shapes", help="comma-separated random-init shapes (llama-1b,llama-8b,tiny): engine vs "
                                     "generate and batch-1 decode bandwidth for each")  # fmt: skip
    ap.add_argument("--peak-gbs", type=float, help="device memory bandwidth in GB/s (default: 4800, an H200, on cuda)")
    ap.add_argument("--engine", choices=["chatpipe", "vllm"], default="chatpipe",
                    help="the engine measured: ours (with vLLM's as a second baseline where its environment is made), "
                         "or vLLM's (in its environment) against HF generate")
    ap.add_argument("--no-vllm-baseline", action="store_true", help="leave vLLM's engine out of our engine's run")
    ap.add_argument("--vllm-only", action="store_true", help=argparse.SUPPRESS)  # the child of vllm_baseline
    args = ap.parse_args()
    from local_broker import enter_engine_env  # bench/, beside this script

    # vLLM's side in the vLLM environment; ours with tcmalloc and 2 MB pages, as `chatpipe inference` runs it
    enter_engine_env(args.engine, __file__, args.threads)
    if args.engine == "vllm" and (args.model_config or args.shapes or args.multi_turn):
        raise SystemExit("--engine vllm runs the default model's workload only (no --model-config, --shapes, "
                         "--multi-turn)")
    if args.threads and args.device == "cpu":
        torch.set_num_threads(args.threads)
    if args.shapes:
        return run_shapes(args)
    if args.multi_turn:
        import engine_multiturn  # bench/ is on sys.path when this script runs

        model, name = load(args)
        print(f"model={name} device={args.device} dtype={next(model.parameters()).dtype} threads={torch.get_num_threads()} "
              f"quick={args.quick}")  # fmt: skip
        return engine_multiturn.run(model, args)
    n, bs, shape = ((16, 8, dict(prompt_median=48, output_median=32, max_prompt=256, max_output=128)) if args.quick
                    else (48, 16, dict(prompt_median=96, output_median=64, max_prompt=512, max_output=256)))
    args.num_requests = args.num_requests or n
    args.batch_size = args.batch_size or bs
    args.repeats = args.repeats or 1
    if args.vllm_only:  # the child of vllm_baseline: the same workload (same seed, vocabulary), vLLM only
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(EngineSettings().default_model_dir(), local_files_only=True).vocab_size
        wl = make_workload(args.num_requests, vocab, args.seed, **shape)
        best = min((run_vllm(wl, args) for _ in range(args.repeats)), key=lambda r: r.seconds)
        print(RESULT_PREFIX + json.dumps(dataclasses.asdict(best)))
        return
    model, name = load(args)
    wl = make_workload(args.num_requests, model.config.vocab_size, args.seed, **shape)
    print(f"model={name} device={args.device} dtype={next(model.parameters()).dtype} threads={torch.get_num_threads()} "
          f"repeats={args.repeats} requests={args.num_requests} batch={args.batch_size} prompt_tokens={sum(map(len, wl.prompts))} "
          f"output_tokens={sum(wl.outputs)} (max prompt {max(map(len, wl.prompts))}, max output {max(wl.outputs)})")  # fmt: skip
    measured = "vllm_engine" if args.engine == "vllm" else "engine"
    runs: dict[str, list[Result]] = {measured: [], "hf_generate": []}
    for _ in range(args.repeats):  # alternate, so a noisy neighbour hurts both sides alike
        runs[measured].append(run_vllm(wl, args) if args.engine == "vllm" else run_engine(model, wl, args))
        runs["hf_generate"].append(run_hf(model, wl, args))
    results = {k: min(v, key=lambda r: r.seconds) for k, v in runs.items()}
    if args.engine == "chatpipe" and not args.no_vllm_baseline and not args.model_config:
        del model  # vLLM loads its own copy, in its own process
        vllm = vllm_baseline(args)
        if vllm is not None:
            results["vllm_engine"] = vllm
    print(f"{'':12} {'tokens/s':>9} {'seconds':>8} {'TTFT p50/p90/p99 (s)':>24} {'TPOT p50/p90/p99 (ms)':>24}")
    for label, r in results.items():
        ttft = "/".join(f"{pct(r.ttft, q):.2f}" for q in (50, 90, 99))
        tpot = "/".join(f"{pct(r.tpot, q) * 1000:.0f}" for q in (50, 90, 99))
        print(f"{label:12} {r.tokens_per_s:9.1f} {r.seconds:8.1f} {ttft:>24} {tpot:>24}")
    ratio = results[measured].tokens_per_s / results["hf_generate"].tokens_per_s
    print(f"{measured}/hf_generate tokens/s ratio = {ratio:.2f}")
    if measured == "engine" and "vllm_engine" in results:  # the headline: ours against the engine users would deploy
        print(f"engine/vllm tokens/s ratio = {results['engine'].tokens_per_s / results['vllm_engine'].tokens_per_s:.2f}")


if __name__ == "__main__":
    main()
