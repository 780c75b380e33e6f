"""The gateway under load from one API key, with the official ``openai`` async client, vs the same requests one at a time.

At each level (16, 64, 256 concurrent streams; ``--quick``: 16 and 64) every stream sends its chat requests
back to back (``stream=True``, usage included, the client's default retries: a 429 is retried after its
``Retry-After``), each in a conversation of its own. Printed per level: requests, errors (what the client
raised after its retries), time to first token (TTFT) and inter-token latency p50 / p99, output tokens/s
(completion tokens over the level's wall time), and goodput: requests whose TTFT met the SLO, per second.

The SLO is ``--ttft-slo-s`` (default 30 s): what an interactive user of one 2-core CPU worker can be
promised when 256 streams share its batch of 8 (on a GPU worker it would be a second or two).

The baseline is the same kind of request sent one at a time (the first ``--baseline`` requests of the
load, each alone: its rates per second stand for the whole load sent that way, which at 256 streams
would take many minutes). The ratios are level / baseline: output tokens/s and goodput.

Each request's deadline is the gateway's (300 s to the first token): admission (gateway/admission.py)
takes a request when its estimated first token fits it and answers 429 with ``Retry-After`` otherwise.

With ``--url`` (and ``--api-key``) it drives a running stack, e.g. ``make run``'s gateway; without, it
starts a broker and the pipeline itself (streams, one inference worker, a gateway: chatpipe/testing),
and also prints the gateway's memory per request in flight (its RSS at the peak of a level less idle).
The last line is the headline: ``load/64 streams vs one at a time goodput ratio = X``.

    python bench/load.py --quick    # about a minute and a half on 2 cores, plus the services' start
    python bench/load.py            # the docs/benchmarks.md figures
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from e2e import ENGINE, MODEL  # the inference worker's engine settings: bench/e2e.py's (bench/, beside this script)
from local_broker import bench_broker, bench_parser, fresh_kafka, percentile


@dataclass
class Level:
    name: str
    wall_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)  # gaps between content chunks of one answer
    tokens: int = 0
    errors: list[str] = field(default_factory=list)
    rss_peak_mib: float = 0.0

    def goodput(self, slo_s: float) -> float:
        """Requests whose first token met the SLO, per second of the level."""
        return sum(t <= slo_s for t in self.ttft_s) / self.wall_s if self.wall_s else 0.0

    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


def prompt_text(i: int) -> str:
    return f"Tell me a short fact about the number {i}."


async def one_request(client, i: int, max_tokens: int, level: Level) -> None:
    """One streamed chat; its TTFT, gaps and tokens into ``level`` (an exception: an error)."""
    started = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt_text(i)}], max_tokens=max_tokens,
            temperature=0.7, stream=True, stream_options={"include_usage": True},
            extra_headers={"X-Chatpipe-Conversation-Id": f"load-{uuid.uuid4().hex[:12]}"})
        last = None
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].delta.content:
                if last is None:
                    level.ttft_s.append(now - started)
                else:
                    level.itl_s.append(now - last)
                last = now
            if chunk.usage is not None:
                level.tokens += chunk.usage.completion_tokens
        if last is None:
            level.ttft_s.append(time.perf_counter() - started)  # an answer with no text: its end is its first token
    except Exception as exc:  # noqa: BLE001 - counted and shown: the bench's point is that none happen
        level.errors.append(f"{type(exc).__name__}: {exc}"[:300])


async def run_level(client, name: str, streams: int, per_stream: int, max_tokens: int, rss) -> Level:
    level = Level(name)
    counter = iter(range(1_000_000))

    async def stream_loop() -> None:
        for _ in range(per_stream):
            await one_request(client, next(counter), max_tokens, level)

    sampler = asyncio.create_task(sample_rss(rss, level)) if rss is not None else None
    started = time.perf_counter()
    await asyncio.gather(*(stream_loop() for _ in range(streams)))
    level.wall_s = time.perf_counter() - started
    if sampler is not None:
        sampler.cancel()
    return level


async def run_baseline(client, n: int, max_tokens: int) -> Level:
    level = Level("one at a time")
    started = time.perf_counter()
    for i in range(n):
        await one_request(client, i, max_tokens, level)
    level.wall_s = time.perf_counter() - started
    return level


async def sample_rss(rss, level: Level) -> None:
    while True:
        level.rss_peak_mib = max(level.rss_peak_mib, rss())
        await asyncio.sleep(0.25)


def rss_of(pid: int):
    def rss() -> float:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0
    return rss


def row(level: Level, slo_s: float, requests: int) -> str:
    ttft, itl = level.ttft_s or [0.0], level.itl_s or [0.0]
    return (f"| {level.name} | {requests} | {len(level.errors)} | {percentile(ttft, 0.5):.2f} | {percentile(ttft, 0.99):.2f} "
            f"| {percentile(itl, 0.5) * 1000:.0f} | {percentile(itl, 0.99) * 1000:.0f} | {level.tokens_per_s():.1f} "
            f"| {level.goodput(slo_s):.3f} |")


async def drive(url: str, api_key: str, args, rss) -> None:
    import openai

    levels = [16, 64] if args.quick else [16, 64, 256]
    per_stream = 1 if args.quick else 2
    max_tokens = 16 if args.quick else 32
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, timeout=300.0)  # max_retries: 2 (default)
    print(f"{MODEL}, max_tokens {max_tokens}, temperature 0.7, TTFT SLO {args.ttft_slo_s:g} s, "
          f"{per_stream} request(s) per stream")
    await run_baseline(client, 2, max_tokens)  # warm: the first requests load what they load
    idle_mib = rss() if rss is not None else 0.0
    baseline = await run_baseline(client, args.baseline or (6 if args.quick else 12), max_tokens)
    results = []
    for streams in levels:
        level = await run_level(client, f"{streams} streams", streams, per_stream, max_tokens, rss)
        results.append((streams, level))
        print(f"  {level.name}: {level.wall_s:.0f} s, {len(level.errors)} errors", flush=True)
        for error in level.errors[:5]:
            print(f"    {error}")
    await client.close()
    print("\n| load | requests | errors | TTFT p50 s | TTFT p99 s | inter-token p50 ms | p99 ms | output tok/s "
          "| goodput req/s |\n|---|---|---|---|---|---|---|---|---|")
    print(row(baseline, args.ttft_slo_s, len(baseline.ttft_s) + len(baseline.errors)))
    for streams, level in results:
        print(row(level, args.ttft_slo_s, streams * per_stream))
    print()
    for streams, level in results:
        print(f"{level.name}: output tokens/s {level.tokens_per_s() / max(baseline.tokens_per_s(), 1e-9):.2f}x, "
              f"goodput {level.goodput(args.ttft_slo_s) / max(baseline.goodput(args.ttft_slo_s), 1e-9):.2f}x "
              "the same requests one at a time")
        if rss is not None:
            print(f"  gateway RSS: {idle_mib:.0f} MiB idle, {level.rss_peak_mib:.0f} MiB at the peak: "
                  f"{(level.rss_peak_mib - idle_mib) * 1024 / streams:.0f} KiB per request in flight")
    errors = sum(len(level.errors) for _, level in results)
    print(f"errors at every level: {errors}")
    at_64 = dict(results)[64]
    ratio = at_64.goodput(args.ttft_slo_s) / max(baseline.goodput(args.ttft_slo_s), 1e-9)
    print(f"load/64 streams vs one at a time goodput ratio = {ratio:.2f}")


def main() -> None:
    parser = bench_parser(__doc__, "16 and 64 streams, one request each, 16 tokens: about a minute and a half")
    parser.add_argument("--url", default=None, help="a running gateway (e.g. http://127.0.0.1:8000); default: "
                                                    "start a broker and the pipeline here")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="the key for --url")
    parser.add_argument("--ttft-slo-s", type=float, default=30.0, help="goodput counts requests whose first "
                                                                       "token came within this")
    parser.add_argument("--baseline", type=int, default=None, help="requests sent one at a time (6; full: 12)")
    args = parser.parse_args()
    if args.url is not None:
        if not args.api_key:
            parser.error("--url needs --api-key (or OPENAI_API_KEY): a key of the gateway's keys file")
        asyncio.run(drive(args.url.rstrip("/"), args.api_key, args, None))
        return
    from chatpipe.testing.gateway import API_KEY, start_pipeline

    with bench_broker(args.bootstrap_servers, prefix="chatpipe-bench-load-") as bootstrap:
        kafka = fresh_kafka(bootstrap, "l")
        root = Path(tempfile.mkdtemp(prefix="chatpipe-bench-load-logs-"))
        started = time.perf_counter()
        worker_env = {f"CHATPIPE_{name.upper()}": str(value) for name, value in {"device": "cpu", **ENGINE}.items()}
        stack = start_pipeline(kafka, root, tracing=False, worker_env=worker_env)
        print(f"pipeline up in {time.perf_counter() - started:.0f} s (logs in {root})")
        try:
            asyncio.run(drive(stack.url, API_KEY, args, rss_of(stack.gateway.proc.pid)))
        finally:
            stack.stop()


if __name__ == "__main__":
    main()
