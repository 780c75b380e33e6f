"""torch.profiler over one engine step, decode-only and mixed, with the costs put in named buckets.

Issue 22 (stage 1): aim each change to the step at a measured cost. For each shape this builds
the engine (the shapes of ``bench/engine.py``: random-init Llama-1B / Llama-8B in bf16 on CUDA,
the real SmolLM2-135M or the random ``tiny`` shape on CPU), fills it with ``--batch`` running
requests of ``--context``-token random prompts, then profiles

  (a) a **decode step**: ``--batch`` single-token rows (contexts ``--context`` + a few tokens);
  (b) a **mixed step**: the same decodes plus one new request's ``--chunk``-token prompt chunk.

Before the profile each step kind is warmed up and timed without the profiler (``wall``: median
of ``--reps`` steps, the figure to compare). The profiled step is labelled on the fly (record_function
wrappers installed on the engine's objects for the profiled step only; ``inference/`` is not
touched) so every op lands in one bucket, the issue's hypotheses:

  HF submodule kernels per layer   non-GEMM ops of the layer math: inside the Hugging Face modules the
                                   runner calls (RMSNorm, rotary embedding + apply_rotary_pos_emb, SiLU*mul,
                                   embedding), or, on the lean path (``lean_layers=on``), inside
                                   lean_llama's rms_norm / add_rms_norm / qkv_rope / mlp
  host->device tensor builds       everything ``ModelRunner.prepare`` does (torch.tensor of lists,
                                   block-table rows, masks)
  device->host syncs               aten::item / _local_scalar_dense, cuda*Synchronize, ``Tensor.tolist``
  KV gather (index_select)         ``PagedKVCache.read_blocks``: the per-layer gather of each context
  SDPA                             aten::scaled_dot_product_attention and what it calls
  paged decode kernel              the decode rows' attention read in place (``ModelRunner.paged_decode``:
                                   the C kernel on CPU, the Triton one on CUDA), where the engine runs one
  GEMMs                            aten::linear / mm / addmm / bmm / matmul and what they call
  KV write (index_copy_)           ``PagedKVCache.write``
  sampling                         ``Sampler.sample_step`` other than its sync
  other ops                        runner glue: views, transposes, residual adds, slicing
  Python outside ops               time in no op at all: the scheduler, prepare's lists, bookkeeping

Per step it prints the wall time, the bucket table (aten calls, GPU kernels, self CPU ms, GPU ms),
op / kernel-launch / memcpy / sync counts, the top ops by self CPU time and (CUDA) the top GPU
kernels, then a markdown summary of all steps for docs/engine.md ("Profile of one step").

    python bench/profile_step.py --quick                                  # CPU, tiny shape, ~15 s
    python bench/profile_step.py --device cpu --shapes smollm2 --lean off,on             # the docs/engine.md CPU table
    python bench/profile_step.py --device cuda --shapes llama-1b,llama-8b --lean auto,off  # bench/gpu_check.sh run

``--lean`` profiles each shape once per ``lean_layers`` setting (a tree without that setting
profiles its only path). Wall times and every profiled figure are medians over the steps.

Last line: ``profile/decode step <first shape> ms = X`` (median wall time, no profiler).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for `engine` (bench/engine.py)

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import engine as bench_engine  # bench/engine.py: MODEL_CONFIGS, load, sync; puts the repo root on sys.path
from inference.engine.engine import Engine
from inference.engine.request import SamplingParams
from inference.engine.settings import EngineSettings

BUCKETS = (
    "HF submodule kernels per layer",
    "host->device tensor builds",
    "device->host syncs",
    "KV gather (index_select) in attention",
    "SDPA",
    "paged decode kernel",
    "GEMMs",
    "KV write (index_copy_)",
    "sampling",
    "other ops",
    "Python outside ops",
)
LABEL = "cp:"  # prefix of this script's record_function labels
SYNC_OPS = {"aten::item", "aten::_local_scalar_dense"}
SYNC_RUNTIME = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize"}  # fmt: skip
LAUNCHES = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchCooperativeKernel",
            "cudaGraphLaunch", "cuGraphLaunch"}  # fmt: skip
GEMM_OPS = {"aten::linear", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::_addmm_activation"}
SDPA_OP = "attention"  # aten::scaled_dot_product_attention, aten::_scaled_dot_product_*_attention*, _flash/_efficient_attention*
SHAPES = sorted(bench_engine.MODEL_CONFIGS) + ["smollm2"]
SMOLLM2 = Path.home() / ".cache" / "chatpipe" / "models" / "smollm2-135m-instruct"


# -- labels: record_function wrappers installed for the profiled step only --------------------------


def _labelled(fn, name: str):
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        with record_function(name):
            return fn(*a, **kw)

    return wrapper


class Labels:
    """Wraps the engine's step phases, the KV cache's gather/write, the HF submodules the runner
    calls and ``Tensor.tolist`` in record_function labels; ``remove()`` restores everything."""

    def __init__(self, engine) -> None:
        self._patches = contextlib.ExitStack()
        core = engine.model.model
        runner, scheduler = engine.runner, engine.scheduler
        for obj, attr, label in ((engine, "step", "step"), (scheduler, "schedule", "schedule"),
                                 (scheduler, "update_from_output", "update"), (runner, "prepare", "prepare"),
                                 (runner, "forward", "forward"), (engine.sampler, "sample_step", "sample"),
                                 (runner.cache, "read_blocks", "kv_gather"), (runner.cache, "write", "kv_write")):
            self._wrap(obj, attr, label)
        if getattr(runner, "paged_decode", None) is not None:
            self._wrap(runner, "paged_decode", "paged_kernel")
        if hasattr(engine.runner, "_rope"):
            self._wrap(engine.runner, "_rope", "layer:rope")
        for name in ("embed_tokens", "rotary_emb", "norm"):
            if hasattr(core, name):
                self._wrap(getattr(core, name), "forward", f"layer:{name}")
        for layer in core.layers:  # the HF modules (the reference path)
            for name in ("input_layernorm", "post_attention_layernorm", "mlp"):
                self._wrap(getattr(layer, name), "forward", f"layer:{name}")
        # The lean path (inference/engine/lean_llama.py, lean_layers=on) where this tree has it: its
        # norm functions as model_runner calls them, and LeanLayer's methods (a frozen dataclass: on the class).
        from inference.engine import model_runner

        for name in ("rms_norm", "add_rms_norm"):
            if callable(getattr(model_runner, name, None)):
                self._wrap(model_runner, name, f"layer:{name}")
        lean = getattr(engine.runner, "lean", None)
        if lean is not None and getattr(lean, "layers", None):
            for name in ("qkv_rope", "mlp"):
                self._wrap(type(lean.layers[0]), name, f"layer:lean_{name}")
        self._wrap(torch.Tensor, "tolist", "sync:tolist")

    def _wrap(self, obj, attr: str, label: str) -> None:
        # patch.object restores what was there: the object's own attribute, or none (back to the class's)
        self._patches.enter_context(mock.patch.object(obj, attr, _labelled(getattr(obj, attr), LABEL + label)))

    def remove(self) -> None:
        self._patches.close()


# -- the steps -------------------------------------------------------------------------------------


class Steps:
    """An engine with ``batch`` requests decoding; ``decode()`` / ``mixed()`` run one step of each kind."""

    def __init__(self, model, args: argparse.Namespace, lean: str | None = None) -> None:
        self.args, self.device = args, args.device
        self.rng = random.Random(args.seed)
        self.vocab = model.config.vocab_size
        # Steps the running requests live through: the prefill (the first admitted decode while the
        # last prefill), then the decode and mixed steps.
        prefill = -(-args.batch * args.context // max(1, args.max_step_tokens - args.batch)) + 2
        steps = prefill + 2 * (args.warmup + args.reps + args.profile_runs + 1) + 8
        max_seq = args.context + steps + 16
        self.params = SamplingParams(max_new_tokens=steps, ignore_eos=True)
        self.extra_params = SamplingParams(max_new_tokens=4, ignore_eos=True)
        settings = EngineSettings(
            device=args.device, max_batch=args.batch + 1, max_seq_len=max(max_seq, args.chunk + 16),
            kv_cache_tokens=(args.batch + 2) * (max_seq + args.chunk + 32), max_step_tokens=args.max_step_tokens,
            max_waiting=args.batch + 4, **({"lean_layers": lean} if lean else {}),
        )  # fmt: skip
        self.engine = Engine(model, settings)
        self.path = "lean" if getattr(self.engine.runner, "lean", None) is not None else "hf"  # the layers' code path
        self.engine.generate([self._prompt(8)], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
        self.reqs = [self.engine.add_request(self._prompt(args.context), self.params)[1] for _ in range(args.batch)]
        while not all(r.output_token_ids for r in self.reqs):  # prefill: every prompt computed
            self.engine.step()
        self.extra = None

    def _prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(10, self.vocab) for _ in range(n)]

    def decode(self) -> float:
        return self._run(0)  # before any mixed(): the caller profiles decode first

    def mixed(self) -> float:
        if self.extra is not None:  # the previous mixed step's request leaves at this step's schedule()
            self.engine.abort(self.extra.request_id)
        _, self.extra = self.engine.add_request(self._prompt(self.args.chunk), self.extra_params)
        return self._run(self.args.chunk)

    def _run(self, prompt_tokens: int) -> float:
        prompts0 = self.engine.stats().prompt_tokens
        bench_engine.sync(self.device)
        t0 = time.perf_counter()
        self.engine.step()
        bench_engine.sync(self.device)
        dt = time.perf_counter() - t0
        after = self.engine.stats()
        computed, running = after.prompt_tokens - prompts0, after.running
        want_running = self.args.batch + (1 if prompt_tokens else 0)
        if computed != prompt_tokens or running != want_running:
            raise RuntimeError(f"step computed {computed} prompt tokens with {running} running; "
                               f"wanted {prompt_tokens} and {want_running} (max_step_tokens too small?)")  # fmt: skip
        return dt


# -- reading the profile ---------------------------------------------------------------------------


@dataclass
class BucketCost:
    calls: int = 0  # aten calls, nested ones included
    leaves: int = 0  # aten calls that call no other aten op (on CPU, the nearest thing to a kernel)
    kernels: int = 0  # GPU kernels launched (memcpy / memset not counted)
    cpu_us: float = 0.0  # self CPU time
    gpu_us: float = 0.0  # GPU time of the kernels and copies the bucket's ops launched


@dataclass
class StepProfile:
    shape: str
    kind: str
    wall_ms: list[float]
    profiled_ms: float
    num_layers: int
    buckets: dict[str, BucketCost] = field(default_factory=lambda: {b: BucketCost() for b in BUCKETS})
    counts: collections.Counter = field(default_factory=collections.Counter)
    phases: dict[str, float] = field(default_factory=dict)  # label -> total CPU ms
    python_ms: dict[str, float] = field(default_factory=dict)  # label -> self CPU ms (time in no op)
    top_cpu: list[tuple[str, int, float, float]] = field(default_factory=list)  # name, calls, self CPU ms, GPU ms
    top_gpu: list[tuple[str, int, float]] = field(default_factory=list)  # kernel, count, ms
    gpu_busy_ms: float = 0.0
    cuda: bool = False
    profile_runs: int = 1
    path: str = "hf"  # the layers' code path: "hf" (the HF modules) or "lean" (lean_llama)

    @property
    def title(self) -> str:
        return f"{self.shape} {self.kind} ({self.path})"

    @property
    def wall(self) -> float:
        return statistics.median(self.wall_ms)


def _chain(evt):
    """The event and its CPU ancestors, innermost first."""
    while evt is not None:
        yield evt
        evt = evt.cpu_parent


def classify(evt) -> str:
    names = [e.name for e in _chain(evt)]
    labels = [n[len(LABEL):] for n in names if n.startswith(LABEL)]
    if names[0] in SYNC_OPS or names[0] in SYNC_RUNTIME or "sync:tolist" in labels:
        return "device->host syncs"
    if "prepare" in labels:
        return "host->device tensor builds"
    if "paged_kernel" in labels:
        return "paged decode kernel"
    if any(SDPA_OP in n for n in names if n.startswith("aten::")):
        return "SDPA"
    if any(n in GEMM_OPS for n in names):
        return "GEMMs"
    if "kv_gather" in labels:
        return "KV gather (index_select) in attention"
    if "kv_write" in labels:
        return "KV write (index_copy_)"
    if any(lb.startswith("layer:") for lb in labels):
        return "HF submodule kernels per layer"
    if "sample" in labels:
        return "sampling"
    return "other ops"


def read_profile(prof, sp: StepProfile, top: int) -> None:
    cpu_ops: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    gpu_kernels: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CPU:
            continue  # device-side rows; their time is read from the CPU op that launched them (evt.kernels)
        name = evt.name
        if name.startswith(LABEL):
            label = name[len(LABEL):]
            if label == "paged_kernel":  # the C kernel is no aten op: its time is the label's own
                b = sp.buckets["paged decode kernel"]
                b.cpu_us += evt.self_cpu_time_total
                b.calls += 1
                b.leaves += 1
                continue
            sp.buckets["Python outside ops"].cpu_us += evt.self_cpu_time_total
            group = "layer:*" if label.startswith("layer:") else label
            sp.python_ms[group] = sp.python_ms.get(group, 0.0) + evt.self_cpu_time_total / 1000
            sp.phases[label] = sp.phases.get(label, 0.0) + evt.cpu_time_total / 1000
            if label == "sync:tolist":
                sp.counts["Tensor.tolist"] += 1
            continue
        b = sp.buckets[classify(evt)]
        b.cpu_us += evt.self_cpu_time_total
        if name.startswith("aten::"):
            b.calls += 1
            b.leaves += not any(ch.name.startswith("aten::") for ch in evt.cpu_children)
            sp.counts["aten calls"] += 1
        if name in SYNC_OPS or name in SYNC_RUNTIME:
            sp.counts[name] += 1
        if name in LAUNCHES:
            sp.counts["kernel launches (runtime calls)"] += 1
        gpu_us = 0.0
        for k in evt.kernels:
            gpu_us += k.duration
            if k.name.startswith("Memcpy"):
                direction = "HtoD" if "HtoD" in k.name else "DtoH" if "DtoH" in k.name else "DtoD"
                sp.counts[f"memcpy {direction}"] += 1
            elif k.name.startswith("Memset"):
                sp.counts["memset"] += 1
            else:
                b.kernels += 1
                sp.counts["GPU kernels"] += 1
            gpu_kernels[k.name][0] += 1
            gpu_kernels[k.name][1] += k.duration
        b.gpu_us += gpu_us
        row = cpu_ops[name]
        row[0] += 1
        row[1] += evt.self_cpu_time_total
        row[2] += gpu_us
    sp.gpu_busy_ms = sum(v[1] for v in gpu_kernels.values()) / 1000
    sp.top_cpu = sorted(((n, int(c), s / 1000, g / 1000) for n, (c, s, g) in cpu_ops.items()), key=lambda r: -r[2])[:top]
    sp.top_gpu = sorted(((n, int(c), d / 1000) for n, (c, d) in gpu_kernels.items()), key=lambda r: -r[2])[:top]


def profile_step(steps: Steps, kind: str, shape: str, args: argparse.Namespace) -> StepProfile:
    run = steps.decode if kind == "decode" else steps.mixed
    for _ in range(args.warmup):
        run()
    wall = [run() * 1000 for _ in range(args.reps)]
    cuda = args.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    runs: list[StepProfile] = []
    labels = Labels(steps.engine)
    try:
        if cuda:  # the profiler's first CUDA session pays CUPTI set-up: throw one away
            with profile(activities=activities):
                run()
        for _ in range(args.profile_runs):
            with profile(activities=activities) as prof:
                run()
            sp = StepProfile(shape, kind, wall, 0.0, steps.engine.model.config.num_hidden_layers, cuda=cuda, path=steps.path)
            read_profile(prof, sp, args.top)
            sp.profiled_ms = sp.phases.get("step", float("nan"))
            runs.append(sp)
    finally:
        labels.remove()
    return median_profile(runs)


def median_profile(runs: list[StepProfile]) -> StepProfile:
    """Each time the median over the profiled steps (on a shared machine one op of one step can be
    descheduled for 100 ms); counts and top tables from the step of median length (counts are the
    same in every step of a kind)."""
    runs = sorted(runs, key=lambda r: r.profiled_ms)
    best = runs[len(runs) // 2]
    med = statistics.median
    for name, b in best.buckets.items():
        b.cpu_us = med([r.buckets[name].cpu_us for r in runs])
        b.gpu_us = med([r.buckets[name].gpu_us for r in runs])
    best.phases = {k: med([r.phases.get(k, 0.0) for r in runs]) for k in best.phases}
    best.python_ms = {k: med([r.python_ms.get(k, 0.0) for r in runs]) for k in best.python_ms}
    best.gpu_busy_ms = med([r.gpu_busy_ms for r in runs])
    best.profiled_ms = best.phases.get("step", float("nan"))
    best.profile_runs = len(runs)
    return best


# -- printing --------------------------------------------------------------------------------------


def _ms(us: float) -> str:
    return f"{us / 1000:.2f}"


def print_step(sp: StepProfile, desc: str) -> None:
    print(f"\n== {sp.shape} {sp.kind} step, {sp.path} layers: {desc}")
    print(f"wall (no profiler): median {sp.wall:.2f} ms of {len(sp.wall_ms)} steps (min {min(sp.wall_ms):.2f}); "
          f"profiled step {sp.profiled_ms:.2f} ms (median of {sp.profile_runs}; every ms below too)" + (f"; GPU busy {sp.gpu_busy_ms:.2f} ms "
          f"({100 * sp.gpu_busy_ms / sp.profiled_ms:.0f}% of the profiled step)" if sp.cuda else ""))  # fmt: skip
    phases = ", ".join(f"{k} {sp.phases[k]:.2f}" for k in ("schedule", "prepare", "forward", "sample", "update") if k in sp.phases)
    print(f"host time by phase (ms, ops included): {phases}")
    over = (sp.profiled_ms - sp.wall) * 1000 / max(1, sp.counts["aten calls"])
    print(f"profiler overhead: {f'about {over:.1f}' if over > 0 else 'n/a (< 0: a noisy machine)'} us per aten call "
          f"(profiled - unprofiled step, medians, over {sp.counts['aten calls']} calls); most of it lands in 'Python outside ops'")
    python = ", ".join(f"{k} {v:.2f}" for k, v in sorted(sp.python_ms.items(), key=lambda kv: -kv[1]))
    print(f"Python outside ops by label (ms; profiler overhead per op included): {python}")
    c = sp.counts
    syncs = "".join(f", {k} {c[k]}" for k in sorted(SYNC_OPS | SYNC_RUNTIME) if c[k])
    line = f"counts: {c['aten calls']} aten calls; Tensor.tolist {c['Tensor.tolist']}{syncs}"
    if sp.cuda:
        line += (f"; {c['kernel launches (runtime calls)']} kernel launches, {c['GPU kernels']} GPU kernels, "
                 f"memcpy HtoD {c['memcpy HtoD']} / DtoH {c['memcpy DtoH']} / DtoD {c['memcpy DtoD']}, memset {c['memset']}")  # fmt: skip
    print(line)
    print(f"{'bucket':40} {'aten calls':>10} {'per layer':>9} {'kernels':>8} {'self CPU ms':>11} {'GPU ms':>8}"
          f"   (per layer: {'GPU kernels' if sp.cuda else 'leaf aten calls'} / {sp.num_layers} layers)")
    for name, b in sp.buckets.items():
        per_layer = (f"{(b.kernels if sp.cuda else b.leaves) / sp.num_layers:.1f}") if name.startswith("HF") else ""
        kernels = str(b.kernels) if sp.cuda else "-"
        gpu = _ms(b.gpu_us) if sp.cuda else "-"
        print(f"{name:40} {b.calls:>10} {per_layer:>9} {kernels:>8} {_ms(b.cpu_us):>11} {gpu:>8}")
    total_cpu = sum(b.cpu_us for b in sp.buckets.values())
    print(f"{'total':40} {c['aten calls']:>10} {'':>9} {c['GPU kernels'] if sp.cuda else '-':>8} {_ms(total_cpu):>11} "
          f"{(f'{sp.gpu_busy_ms:.2f}' if sp.cuda else '-'):>8}")  # fmt: skip
    print(f"top {len(sp.top_cpu)} ops by self CPU time:")
    print(f"  {'op':48} {'calls':>6} {'self CPU ms':>11} {'GPU ms':>8}")
    for name, calls, cpu_ms, gpu_ms in sp.top_cpu:
        print(f"  {name[:48]:48} {calls:>6} {cpu_ms:>11.3f} {(f'{gpu_ms:.3f}' if sp.cuda else '-'):>8}")
    if sp.cuda:
        print(f"top {len(sp.top_gpu)} GPU kernels by time:")
        for name, count, ms in sp.top_gpu:
            print(f"  {name[:80]:80} {count:>5} {ms:>8.3f}")


def print_markdown(profiles: list[StepProfile]) -> None:
    """One column per (shape, step): the figures docs/engine.md's table takes."""
    cuda = any(p.cuda for p in profiles)
    print("\nmarkdown (docs/engine.md, 'Profile of one step'); cells: self CPU ms" + (" / GPU ms" if cuda else "") + " (aten calls)")
    print("| | " + " | ".join(p.title for p in profiles) + " |")
    print("|---" * (len(profiles) + 1) + "|")
    print("| wall, no profiler: median (min), ms | " + " | ".join(f"**{p.wall:.2f}** ({min(p.wall_ms):.2f})" for p in profiles) + " |")
    print(f"| profiled step (median of {profiles[0].profile_runs}), ms | " + " | ".join(f"{p.profiled_ms:.2f}" for p in profiles) + " |")
    if cuda:
        print("| GPU busy, ms | " + " | ".join(f"{p.gpu_busy_ms:.2f}" for p in profiles) + " |")
        print("| kernel launches / GPU kernels | " + " | ".join(
            f"{p.counts['kernel launches (runtime calls)']} / {p.counts['GPU kernels']}" for p in profiles) + " |")  # fmt: skip
        print("| memcpy HtoD / DtoH | " + " | ".join(f"{p.counts['memcpy HtoD']} / {p.counts['memcpy DtoH']}" for p in profiles) + " |")
    print("| aten calls | " + " | ".join(str(p.counts["aten calls"]) for p in profiles) + " |")
    print("| syncs: item / tolist / cuda*Synchronize | " + " | ".join(
        f"{p.counts['aten::item']} / {p.counts['Tensor.tolist']} / {sum(p.counts[k] for k in SYNC_RUNTIME)}" for p in profiles) + " |")  # fmt: skip
    for name in BUCKETS:
        cells = []
        for p in profiles:
            b = p.buckets[name]
            cell = _ms(b.cpu_us) + (f" / {_ms(b.gpu_us)}" if cuda and name != "Python outside ops" else "")
            if name != "Python outside ops":
                per = b.kernels if p.cuda else b.leaves
                cell += f" ({b.calls}" + (f", {per / p.num_layers:.0f} {'kernels' if p.cuda else 'leaf calls'}/layer" if name.startswith("HF") else "") + ")"
            cells.append(cell)
        print(f"| {name} | " + " | ".join(cells) + " |")


# -- main ------------------------------------------------------------------------------------------


def build(shape: str, args: argparse.Namespace):
    ns = argparse.Namespace(device=args.device, dtype=args.dtype, model_config=None if shape == "smollm2" else shape)
    if shape == "smollm2" and not SMOLLM2.exists():
        sys.exit(f"profile_step: {SMOLLM2} is missing (run `chatpipe model pull`, or use --shapes tiny)")
    return bench_engine.load(ns)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer timed steps; on CPU the tiny shape at batch 8 (~20 s)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--shapes", help=f"comma-separated, of {','.join(SHAPES)} (default: llama-1b,llama-8b on CUDA; "
                                     "on CPU smollm2 if pulled, else tiny; tiny with --quick)")  # fmt: skip
    ap.add_argument("--batch", type=int, help="running requests (decodes per step); default 32 (8 with --quick on CPU)")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens of each running request")
    ap.add_argument("--chunk", type=int, default=256, help="prompt tokens of the mixed step's new request")
    ap.add_argument("--max-step-tokens", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, help="timed steps of each kind (default 10; 5 with --quick)")
    ap.add_argument("--profile-runs", type=int, help="profiled steps of each kind, medians reported (default 5 on CPU, 3 on CUDA; 2 with --quick)")
    ap.add_argument("--lean", default="", help="comma-separated lean_layers settings (auto,on,off) to profile each shape "
                                                "with, one engine each; default: the engine's default only")  # fmt: skip
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1, as bench/engine.py)")
    args = ap.parse_args()
    if args.device == "cpu":  # our engine runs with tcmalloc preloaded, as `chatpipe inference` runs it
        from infra.allocator import run_with_tcmalloc

        run_with_tcmalloc([__file__, *sys.argv[1:]], EngineSettings().allocator)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        sys.exit("profile_step: --device cuda but torch.cuda.is_available() is False")
    if not cuda and args.threads:
        torch.set_num_threads(args.threads)
    if not args.shapes:
        args.shapes = "llama-1b,llama-8b" if cuda else ("tiny" if args.quick or not SMOLLM2.exists() else "smollm2")
    args.batch = args.batch or (8 if args.quick and not cuda else 32)
    args.reps = args.reps or (5 if args.quick else 10)
    args.profile_runs = args.profile_runs or (2 if args.quick else 3 if cuda else 5)
    if args.batch + args.chunk > args.max_step_tokens:
        sys.exit(f"profile_step: --batch + --chunk ({args.batch + args.chunk}) must fit in --max-step-tokens ({args.max_step_tokens})")
    shapes = args.shapes.split(",")
    for s in shapes:
        if s not in SHAPES:
            sys.exit(f"profile_step: unknown shape {s!r}; one of {', '.join(SHAPES)}")
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0) if cuda else f'cpu ({torch.get_num_threads()} threads)'}; "
          f"batch {args.batch}, context {args.context}, chunk {args.chunk}, warmup {args.warmup}, reps {args.reps}", flush=True)  # fmt: skip
    lean_modes: list[str | None] = [m for m in args.lean.split(",") if m] or [None]
    if lean_modes != [None] and "lean_layers" not in EngineSettings.model_fields:
        print(f"(--lean {args.lean}: this tree's EngineSettings has no lean_layers; profiling its only path)")
        lean_modes = [None]
    profiles: list[StepProfile] = []
    for shape in shapes:
        t0 = time.monotonic()
        model, name = build(shape, args)
        for lean in lean_modes:
            t1 = time.monotonic()
            steps = Steps(model, args, lean)
            built = time.monotonic() - t1
            for kind in ("decode", "mixed"):  # decode first: mixed() leaves a request running
                contexts = [r.num_tokens for r in steps.reqs]
                sp = profile_step(steps, kind, shape, args)
                desc = (f"{args.batch} decodes (contexts {min(contexts)}-{max(contexts)} tokens)"
                        + (f" + one {args.chunk}-token prompt chunk" if kind == "mixed" else ""))
                print_step(sp, f"{name}, {next(model.parameters()).dtype}, lean_layers={lean or 'default'}, {desc}")
                profiles.append(sp)
            print(f"({shape}, {steps.path} layers: engine built and prefilled in {built:.0f} s, {time.monotonic() - t1:.0f} s in all)", flush=True)
            del steps
            torch.cuda.empty_cache()  # a no-op where CUDA was never initialised
        print(f"({shape}: {time.monotonic() - t0:.0f} s with the model build)", flush=True)
        del model
        torch.cuda.empty_cache()
    print_markdown(profiles)
    print()
    for sp in reversed(profiles[1:]):
        print(f"profile/{sp.kind} step {sp.shape} ({sp.path}) ms = {sp.wall:.2f}")
    sp = profiles[0]  # the headline, last: the first shape's decode step on the first --lean setting
    print(f"profile/{sp.kind} step {sp.shape} ms = {sp.wall:.2f}")


if __name__ == "__main__":
    main()
