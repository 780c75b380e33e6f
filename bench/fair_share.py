"""bench/load.py with two tenants: does a light tenant keep its latency while a heavy one floods the worker, and
does the heavy one get the whole worker back when the light one stops (work-conserving)?

Two API keys of two tenants drive the gateway with the official ``openai`` async client (streaming):

- **light**: ``--light`` streams (2) of short answers (``max_tokens`` 16), back to back;
- **heavy**: 4x as many streams (8: the worker's whole batch) of long generations (``max_tokens`` 160, a prompt
  that asks for a long story).

Four phases of ``--phase-s`` seconds each (quick: 15, full: 40), in this order: light alone, heavy alone, both
together, heavy alone again (the light tenant idle after it competed). The heavy streams start 5 s before a
phase's window, so the light tenant comes to a worker the heavy one already fills (all arriving in the same
instant would measure the prompts' first prefill instead). At a phase's end the heavy streams are
cancelled (the gateway sends chat.cancels, the worker stops them) and the light ones finish the answer they are
on. Measured: the light tenant's time to first token (TTFT) p50 / p99, the heavy tenant's output tokens/s inside
the phase's window (each stream's chunks that arrived in it, times its tokens per chunk).

The two ratios the issue asks for, printed last:

    light p99 TTFT, both / light alone        (fair: at most 1.5)
    heavy tokens/s, light idle / heavy alone  (work-conserving: at least 0.9)

With ``--compare`` the same phases run a second time on a worker with ``CHATPIPE_QUEUE_POLICY=priority`` (FCFS
inside a class, what the engine did before the fair share), so the table shows what fairness changes; full runs
only (a second pipeline start).

    python bench/fair_share.py --quick    # about 1.5 min on 2 cores plus the pipeline's start
    python bench/fair_share.py --compare  # the docs/benchmarks.md figures
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from e2e import ENGINE, MODEL  # the inference worker's engine settings (bench/, beside this script)
from local_broker import bench_broker, bench_parser, fresh_kafka, percentile

LIGHT_MAX_TOKENS = 16
HEAVY_MAX_TOKENS = 160
RAMP_S = 5.0  # the heavy streams' head start in a phase: their prompts are in and the batch is full


@dataclass
class Tenant:
    ttft_s: list[float] = field(default_factory=list)
    tokens_in_window: float = 0.0
    requests: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass
class Phase:
    name: str
    window_s: float
    light: Tenant = field(default_factory=Tenant)
    heavy: Tenant = field(default_factory=Tenant)

    def heavy_tokens_per_s(self) -> float:
        return self.heavy.tokens_in_window / self.window_s


async def one_request(client, text: str, max_tokens: int, tenant: Tenant, window: list[float]) -> None:
    """One streamed chat; its TTFT, and its tokens that arrived inside ``window`` (perf_counter seconds)."""
    started = time.perf_counter()
    chunk_times: list[float] = []
    tokens = 0
    try:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0.7,
            stream=True, stream_options={"include_usage": True},
            extra_headers={"X-Chatpipe-Conversation-Id": f"fair-{uuid.uuid4().hex[:12]}"})
        try:
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    if not chunk_times:
                        tenant.ttft_s.append(time.perf_counter() - started)
                    chunk_times.append(time.perf_counter())
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
        finally:
            await stream.close()  # cancelled at the phase's end: the gateway sees the client go
        tenant.requests += 1
    except Exception as exc:  # noqa: BLE001 - counted and shown: the bench's point is that none happen
        tenant.errors.append(f"{type(exc).__name__}: {exc}"[:300])
    finally:  # cancelled by the phase's end before its usage came: about a token per chunk
        per_chunk = tokens / len(chunk_times) if chunk_times and tokens else 1.0
        tenant.tokens_in_window += per_chunk * sum(window[0] <= t <= window[1] for t in chunk_times)


async def run_phase(clients, name: str, seconds: float, light_streams: int, heavy_streams: int) -> Phase:
    """The heavy streams start first and have ``RAMP_S`` to fill the worker; then the light ones start and the
    phase's window (``seconds``) begins: the light tenant comes to a worker the heavy one already fills."""
    light_client, heavy_client = clients
    phase = Phase(name, seconds)
    window = [math.inf, math.inf]
    counter = iter(range(1_000_000))

    async def loop(client, tenant: Tenant, text: str, max_tokens: int) -> None:
        while time.perf_counter() < window[1]:
            await one_request(client, text.format(next(counter)), max_tokens, tenant, window)

    heavy = [asyncio.create_task(loop(heavy_client, phase.heavy, "Write a long, detailed story about a town "
                                      "called Number {} and everyone who lives there.", HEAVY_MAX_TOKENS))
             for _ in range(heavy_streams)]
    if heavy_streams:
        await asyncio.sleep(RAMP_S)
    window[:] = [time.perf_counter(), time.perf_counter() + seconds]
    light = [asyncio.create_task(loop(light_client, phase.light, "Tell me a short fact about the number {}.",
                                      LIGHT_MAX_TOKENS)) for _ in range(light_streams)]
    await asyncio.sleep(seconds)
    for task in heavy:
        task.cancel()
    await asyncio.gather(*heavy, return_exceptions=True)
    await asyncio.gather(*light)
    await asyncio.sleep(2.0)  # the cancelled generations leave the engine before the next phase
    return phase


def row(phase: Phase) -> str:
    light = phase.light.ttft_s or [0.0]
    errors = len(phase.light.errors) + len(phase.heavy.errors)
    return (f"| {phase.name} | {phase.light.requests} | {percentile(light, 0.5):.2f} | {percentile(light, 0.99):.2f} "
            f"| {phase.heavy.requests} | {phase.heavy_tokens_per_s():.1f} | {errors} |")


async def drive(url: str, keys: tuple[str, str], args, policy: str) -> list[Phase]:
    import openai

    clients = tuple(openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, timeout=300.0) for key in keys)
    light_n = args.light
    heavy_n = 4 * light_n
    seconds = args.phase_s or (15.0 if args.quick else 40.0)
    await run_phase(clients, "warm-up", 5.0, light_n, heavy_n)  # first requests load what they load
    phases = []
    for name, light, heavy in (("light alone", light_n, 0), ("heavy alone", 0, heavy_n),
                               ("both", light_n, heavy_n), ("heavy, light idle", 0, heavy_n)):
        phase = await run_phase(clients, name, seconds, light, heavy)
        phases.append(phase)
        print(f"  [{policy}] {name}: light {phase.light.requests} answers, heavy "
              f"{phase.heavy_tokens_per_s():.1f} tokens/s", flush=True)
        for error in (phase.light.errors + phase.heavy.errors)[:5]:
            print(f"    {error}")
    for client in clients:
        await client.close()
    return phases


def ratios(phases: list[Phase]) -> tuple[float, float]:
    """(light p99 TTFT both / alone, heavy tokens/s with light idle / heavy alone)."""
    alone, heavy, both, after = phases
    light_p99 = [percentile(p.light.ttft_s or [0.0], 0.99) for p in (both, alone)]
    return (light_p99[0] / max(light_p99[1], 1e-9),
            after.heavy_tokens_per_s() / max(heavy.heavy_tokens_per_s(), 1e-9))


def report(results: dict[str, list[Phase]]) -> None:
    for policy, phases in results.items():
        print(f"\nqueue policy {policy}\n\n| phase | light answers | light TTFT p50 s | light TTFT p99 s | heavy answers "
              "| heavy output tok/s | errors |\n|---|---|---|---|---|---|---|")
        for phase in phases:
            print(row(phase))
    print()
    for policy, phases in results.items():
        light, heavy = ratios(phases)
        print(f"{policy}: light p99 TTFT both / alone = {light:.2f}x; heavy tokens/s light idle / alone = {heavy:.2f}x")
    phases = results["fair"]
    light, heavy = ratios(phases)
    print(f"errors: {sum(len(p.light.errors) + len(p.heavy.errors) for p in phases)}")
    print(f"fair_share/heavy tokens/s with the light tenant idle vs alone = {heavy:.2f}x")
    print(f"fair_share/light tenant p99 TTFT beside the heavy one vs alone = {light:.2f}x")


def run_policy(bootstrap: str, policy: str, args) -> list[Phase]:
    from chatpipe.testing.gateway import API_KEY, OTHER_TENANT_KEY, start_pipeline

    kafka = fresh_kafka(bootstrap, "f")
    root = Path(tempfile.mkdtemp(prefix="chatpipe-bench-fair-logs-"))
    started = time.perf_counter()
    worker_env = {f"CHATPIPE_{name.upper()}": str(value) for name, value in {"device": "cpu", **ENGINE}.items()}
    stack = start_pipeline(kafka, root, tracing=False, worker_env={**worker_env, "CHATPIPE_QUEUE_POLICY": policy})
    print(f"[{policy}] pipeline up in {time.perf_counter() - started:.0f} s (logs in {root})")
    try:
        return asyncio.run(drive(stack.url, (API_KEY, OTHER_TENANT_KEY), args, policy))
    finally:
        stack.stop()


def main() -> None:
    parser = bench_parser(__doc__, "phases of 15 s instead of 40: about 1.5 min plus the pipeline's start")
    parser.add_argument("--light", type=int, default=2, help="the light tenant's streams; the heavy one sends 4x")
    parser.add_argument("--phase-s", type=float, default=None, help="seconds per phase (15; full: 40)")
    parser.add_argument("--compare", action="store_true", help="also run the FCFS queue (queue_policy priority) "
                                                               "as the baseline; not with --quick")
    args = parser.parse_args()
    if args.compare and args.quick:
        parser.error("--compare starts a second pipeline: a full run only")
    results: dict[str, list[Phase]] = {}
    with bench_broker(args.bootstrap_servers, prefix="chatpipe-bench-fair-") as bootstrap:
        print(f"{MODEL}, worker batch {ENGINE['max_batch']}: light {args.light} streams x {LIGHT_MAX_TOKENS} tokens, "
              f"heavy {4 * args.light} streams x {HEAVY_MAX_TOKENS} tokens")
        if args.compare:
            results["priority"] = run_policy(bootstrap, "priority", args)
        results["fair"] = run_policy(bootstrap, "fair", args)
    report(results)


if __name__ == "__main__":
    main()
