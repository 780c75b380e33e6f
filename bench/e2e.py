"""The whole path (gateway + Kafka + streams + inference worker) vs the engine alone, same requests, one run.

A client sends chat requests to the gateway over loopback HTTP (streamed, greedy, the same
prompts and max_tokens); the gateway produces them to Kafka, the streams worker assembles their
context, the inference worker generates, and the tokens come back through the gateway's reply
topic as server-sent events. The baseline is the engine alone in this process (``AsyncEngine``
with the worker's text deltas, as bench/worker.py does), with the worker's engine settings (max
batch, KV budget, context, threads), on exactly the requests the worker received: the
``InferenceRequest`` records the streams worker produced are read back from
``chat.inference.requests``, so both sides prefill the same prompt tokens (checked and printed).

1. Throughput: N requests at once on each side; tokens/s = completion tokens / wall time from
   the first send to the last answer. After one untimed round of the same size on each side, the
   sides alternate for a few rounds (4 with ``--quick``, 3 full); the best round of each is compared
   (the machine is shared: the best round is the least disturbed one). Each round uses fresh users
   and conversations, so no round recalls another's turns and every round's contexts are the same.
2. Time to first token, each prompt alone, on both sides back to back: client-side sent -> first
   content token through the gateway vs submit -> first token of the engine; the difference per
   prompt is what the whole path adds (HTTP, two Kafka hops in, context assembly, one hop back).
   Where a lone prompt's time went is printed per hop (p50), from the records' own timestamps (the
   producers' CreateTime on ``chat.prompts``, ``chat.inference.requests`` and the gateway's reply
   topic, the worker's ``queue_ms``; one machine, one clock): gateway, streams, to the worker, the
   worker to its first chunk, and back to the client.
   TTFT under load (the requests of part 1) is printed for both sides too.

Starts its own broker (bench/local_broker.py) unless ``--bootstrap-servers`` is given, and the
pipeline processes as the gateway tests do (chatpipe/testing/gateway.py). The last line is the
headline: ``e2e/gateway+kafka+streams+worker vs engine tokens/s ratio = X``.

    python bench/e2e.py --quick     # about a minute or two on 2 CPU cores (plus the services' start)
    python bench/e2e.py             # the docs/gateway_load.md figures
    python bench/e2e.py --engine vllm [--quick]   # vLLM's engine in the worker and alone (its environment)
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from local_broker import (add_engine_arg, bench_broker, bench_parser, broker_pid, cpu_of, cpu_since, engine_alone,
                          enter_engine_env, fresh_kafka, load_engine, percentile)  # bench/, beside this script

MODEL = "smollm2-135m-instruct"
CONTEXT_TOKENS = 1024
# The inference worker's engine settings (CHATPIPE_* variables) and the in-process engine's: the same.
ENGINE = {"max_batch": 8, "kv_cache_tokens": 8 * CONTEXT_TOKENS, "max_seq_len": CONTEXT_TOKENS, "num_threads": 2}


@dataclass
class Side:
    """One side's measurements: throughput rounds and TTFTs (seconds)."""

    rates: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    ttft_load: list[float] = field(default_factory=list)
    ttft_alone: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)  # of the last round's requests
    # per round: CPU seconds each process other than the inference worker used meanwhile
    cpu: list[dict[str, float]] = field(default_factory=list)


def with_cpu(pids: dict[str, int], side: Side, run, leave_out: str | None = None):
    """``run()``'s result; the CPU seconds each of ``pids`` used meanwhile go to ``side.cpu`` (without
    ``leave_out``)."""
    before = cpu_of(pids)
    result = run()
    side.cpu.append({name: cpu for name, cpu in cpu_since(pids, before).items() if name != leave_out})
    return result


def prompt_text(i: int) -> str:
    return f"Tell me a fact about the number {i} and why it matters."


# -- the whole path: HTTP to the gateway --------------------------------------------------------

@dataclass
class Answer:
    request_id: str
    ttft_s: float
    completion_tokens: int
    prompt_tokens: int
    sent_ms: float = 0.0  # wall clock (the records' timestamps' clock, one machine): the request sent ...
    first_ms: float = 0.0  # ... and its first content token read


async def ask(http, url: str, key: str, i: int, max_tokens: int, user: str) -> Answer:
    body = {"model": MODEL, "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": prompt_text(i)}], "user": user,
            "stream_options": {"include_usage": True}}
    sent, sent_ms = time.perf_counter(), time.time() * 1000
    first, first_ms, usage, done = None, 0.0, None, False
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {key}"}) as response:
        if response.status_code != 200:
            raise SystemExit(f"gateway answered {response.status_code}: {(await response.aread())[:300]!r}")
        request_id = response.headers["X-Chatpipe-Request-Id"]
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                raise SystemExit(f"error mid-stream: {event['error']}")
            usage = event.get("usage") or usage
            if first is None and any(c["delta"].get("content") for c in event.get("choices", [])):
                first, first_ms = time.perf_counter(), time.time() * 1000
    if not done or usage is None:
        raise SystemExit(f"request {request_id}: the stream ended without usage/[DONE]")
    return Answer(request_id, (first or time.perf_counter()) - sent, usage["completion_tokens"], usage["prompt_tokens"],
                  sent_ms, first_ms)


async def through_gateway(url: str, key: str, indices: list[int], max_tokens: int, tag: str) -> tuple[float, list[Answer]]:
    """(seconds, answers) of these prompts sent at once, each by a fresh user in a new conversation."""
    import httpx

    limits = httpx.Limits(max_connections=len(indices) + 4)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600)) as http:
        start = time.perf_counter()
        answers = await asyncio.gather(*(ask(http, url, key, i, max_tokens, f"bench-{tag}-{i}") for i in indices))
        return time.perf_counter() - start, list(answers)


# -- the pipeline ---------------------------------------------------------------------------------

def start_stack(kafka, root: Path, max_pending: int, tracing: bool = False, engine: str = "chatpipe"):
    """Streams + one inference worker (ENGINE settings) + one gateway: chatpipe/testing/gateway.py's
    ``start_pipeline``; with ``tracing``, every process writes its spans under ``root/traces``, else
    none records any."""
    from chatpipe.testing.gateway import API_KEY, start_pipeline

    worker_env = {f"CHATPIPE_{name.upper()}": str(value) for name, value in {"device": "cpu", **ENGINE}.items()}
    worker_env["CHATPIPE_WORKER_ENGINE"] = engine
    stack = start_pipeline(kafka, root, tracing=tracing, worker_env=worker_env,
                           gateway_env={"CHATPIPE_GATEWAY_MAX_PENDING": str(max_pending)})
    return stack, API_KEY


def worker_requests(kafka, request_ids: list[str], timeout_s: float = 60) -> list:
    """The InferenceRequests the streams worker produced for these ids, in the same order."""
    from chatpipe.testing.streams import Tap

    tap = Tap(kafka, "chat.inference.requests")
    try:
        wanted = set(request_ids)
        found = {r.request_id: r for r in tap.records(len(wanted), timeout_s, where=lambda r: r.request_id in wanted)}
    finally:
        tap.close()
    return [found[rid] for rid in request_ids]


def hops(kafka, answers: list[Answer]) -> dict[str, list[float]]:
    """Where each lone prompt's time to first token went, in ms, from the records' timestamps (the
    producers' CreateTime; one machine, one clock) and the worker's own queue time."""
    from confluent_kafka import OFFSET_BEGINNING, TopicPartition

    from transport import clients as kafka_clients

    from schemas.codec import default_codec
    from schemas.topics import spec

    codec = default_codec()
    replies = [t for t in kafka_clients.admin(kafka).list_topics(timeout=10).topics
               if t.startswith(kafka.topic("chat.replies") + ".")]
    topics = {kafka.topic(n): spec(n).partitions for n in ("chat.prompts", "chat.inference.requests", "chat.responses")}
    consumer = kafka_clients.consumer(kafka, "e2e-hops", {"enable.auto.commit": False, "enable.partition.eof": True})
    consumer.assign([TopicPartition(t, p, OFFSET_BEGINNING) for t, n in {**topics, **{r: 1 for r in replies}}.items()
                     for p in range(n)])
    wanted = {a.request_id for a in answers}
    prompt_at, request_at, enqueued_at, queue_ms, first_chunk_at = {}, {}, {}, {}, {}
    eof, partitions, deadline = set(), sum(topics.values()) + len(replies), time.monotonic() + 30
    while len(eof) < partitions and time.monotonic() < deadline:
        for msg in consumer.consume(500, 0.2):
            if msg.error() is not None:
                eof.add((msg.topic(), msg.partition()))
                continue
            record, stamp = codec.decode(msg.value()), msg.timestamp()[1]
            if record.request_id not in wanted:
                continue
            if msg.topic() == kafka.topic("chat.prompts"):
                prompt_at[record.request_id] = stamp
            elif msg.topic() == kafka.topic("chat.inference.requests"):
                request_at[record.request_id], enqueued_at[record.request_id] = stamp, record.enqueued_at
            elif msg.topic() == kafka.topic("chat.responses"):
                queue_ms[record.request_id] = record.queue_ms
            elif record.text and record.request_id not in first_chunk_at:
                first_chunk_at[record.request_id] = stamp
    consumer.close()
    out: dict[str, list[float]] = {k: [] for k in ("gateway", "streams", "to worker", "worker", "back")}
    for a in answers:
        r = a.request_id
        if not all(r in d for d in (prompt_at, request_at, queue_ms, first_chunk_at)):
            continue
        out["gateway"].append(prompt_at[r] - a.sent_ms)  # HTTP in, PromptRequest produced
        out["streams"].append(request_at[r] - prompt_at[r])  # chat.prompts -> InferenceRequest produced
        out["to worker"].append(queue_ms[r])  # enqueued_at -> the worker takes it
        out["worker"].append(first_chunk_at[r] - enqueued_at[r] - queue_ms[r])  # taken -> first chunk produced
        out["back"].append(a.first_ms - first_chunk_at[r])  # reply topic -> gateway -> SSE -> client
    return out


# -- the run --------------------------------------------------------------------------------------

def main() -> None:
    parser = bench_parser(__doc__, "about a minute or two on 2 cores")
    parser.add_argument("--tracing", action="store_true",
                        help="instead: the pipeline with spans recorded vs without (two stacks, alternating rounds)")
    add_engine_arg(parser, "the engine of the worker and of the engine-alone side")
    args = parser.parse_args()
    enter_engine_env(args.engine, __file__, ENGINE.get("num_threads"))
    with bench_broker(args.bootstrap_servers, prefix="chatpipe-bench-e2e-") as bootstrap:
        if args.tracing:
            run_tracing(bootstrap, args.quick)
        else:
            run(bootstrap, args.quick, args.engine)


def run_tracing(bootstrap: str, quick: bool) -> None:
    """Tracing on vs off: two whole pipelines on one broker (topic prefixes of their own), one writing
    every span to files (transport/spans.py), one recording none; the same requests, rounds
    alternating between them (who goes first alternates too), so both see the same machine. Ratio:
    median of the rounds' tokens/s, on / off."""
    from clients.traces import read_span_files

    n, max_tokens, rounds = (8, 16, 4) if quick else (32, 48, 8)
    root = Path(tempfile.mkdtemp(prefix="chatpipe-bench-e2e-tracing-"))
    stacks = {}
    try:
        for side in ("off", "on"):
            kafka = fresh_kafka(bootstrap, f"t{side}")
            started = time.perf_counter()
            stacks[side] = start_stack(kafka, root / side, max_pending=max(32, 2 * n), tracing=side == "on")
            print(f"pipeline with tracing {side} up in {time.perf_counter() - started:.0f} s (logs in {root / side})")
        for side, (stack, key) in stacks.items():
            asyncio.run(through_gateway(stack.url, key, list(range(4)), 4, f"warm-{side}"))
        rates: dict[str, list[float]] = {"off": [], "on": []}
        for round_no in range(rounds):
            order = ("off", "on") if round_no % 2 == 0 else ("on", "off")
            for side in order:
                stack, key = stacks[side]
                secs, answers = asyncio.run(through_gateway(stack.url, key, list(range(n)), max_tokens,
                                                            f"{side}{round_no}"))
                rates[side].append(sum(a.completion_tokens for a in answers) / secs)
    finally:
        for stack, _ in stacks.values():
            stack.stop_all()
    traces = root / "on" / "traces"
    spans = read_span_files(traces) if traces.is_dir() else []
    requests = {r.attributes.get("chatpipe.request_id") for r in spans if r.name.startswith("POST")}
    print(f"\n{n} requests at once x max {max_tokens} tokens, greedy, {rounds} alternating rounds per side")
    for side in ("off", "on"):
        print(f"tracing {side:3}: tokens/s per round {', '.join(f'{r:.1f}' for r in rates[side])}; "
              f"median {statistics.median(rates[side]):.1f}")
    print(f"spans written with tracing on: {len(spans)} for {len(requests)} HTTP requests "
          f"({len(spans) / max(1, len(requests)):.1f} per request, batch receives included)")
    pairs = [on / off for on, off in zip(rates["on"], rates["off"])]
    print(f"ratio per round: {', '.join(f'{p:.2f}' for p in pairs)}")
    print(f"e2e tracing on vs off tokens/s ratio = {statistics.median(rates['on']) / statistics.median(rates['off']):.2f}")


def run(bootstrap: str, quick: bool, engine_name: str = "chatpipe") -> None:
    n, max_tokens, n_alone, rounds = (8, 16, 6, 4) if quick else (32, 48, 20, 3)

    from inference.engine.settings import EngineSettings

    kafka = fresh_kafka(bootstrap, "e")
    root = Path(tempfile.mkdtemp(prefix="chatpipe-bench-e2e-logs-"))
    started = time.perf_counter()
    stack, key = start_stack(kafka, root, max_pending=max(32, 2 * n), engine=engine_name)
    print(f"engine {engine_name}: pipeline up in {time.perf_counter() - started:.0f} s (logs in {root})")
    settings = EngineSettings(device="cpu", **ENGINE)
    engine, tokenizer = load_engine(engine_name, settings)
    url = stack.url
    pipe, alone = Side(), Side()
    # The processes that share the machine's cores with the inference worker (the broker only when
    # started here); "client" is this process: the HTTP client's side of the pipeline's rounds, and
    # the engine itself in the engine-alone rounds (left out of those).
    others = {"broker": broker_pid(bootstrap), "streams": stack.streams.proc.pid, "gateway": stack.gateway.proc.pid,
              "client": os.getpid()}
    others = {name: pid for name, pid in others.items() if pid is not None}
    try:
        # Warm-up: one whole untimed round on each side, in the timed rounds' order. A pipeline round at
        # full size pays once for what a serving pipeline has paid already (the worker's kernels for each
        # batch size, the streams embedder's for a batch of n prompts), and after its answers streams
        # still embeds its turns for memory: every timed pipeline round follows an engine-alone round, as
        # a pipeline round right after another (or after a smaller warm-up) ran at 72-81% of the next in 3 of 4 runs.
        indices = list(range(n))
        _, warm = asyncio.run(through_gateway(url, key, indices, max_tokens, "warm"))
        asyncio.run(engine_alone(engine, tokenizer, worker_requests(kafka, [a.request_id for a in warm]),
                                 first_text=True))
        # Round 0 of the pipeline also yields the requests the worker saw: the engine's requests.
        secs, answers = with_cpu(others, pipe, lambda: asyncio.run(through_gateway(url, key, indices, max_tokens, "r0")))
        requests = worker_requests(kafka, [a.request_id for a in answers])
        for round_no in range(rounds):
            if round_no:
                secs, answers = with_cpu(others, pipe, lambda: asyncio.run(
                    through_gateway(url, key, indices, max_tokens, f"r{round_no}")))
            pipe.rates.append(sum(a.completion_tokens for a in answers) / secs)
            pipe.tokens.append(sum(a.completion_tokens for a in answers))
            pipe.ttft_load += [a.ttft_s for a in answers]
            pipe.prompt_tokens = [a.prompt_tokens for a in answers]
            secs, outs, ttfts, alone.prompt_tokens = with_cpu(others, alone, lambda: asyncio.run(
                engine_alone(engine, tokenizer, requests, first_text=True)), leave_out="client")
            alone.rates.append(sum(outs) / secs)
            alone.tokens.append(sum(outs))
            alone.ttft_load += ttfts
        lone: list[Answer] = []
        for i in range(n_alone):  # each prompt alone, on both sides back to back
            req = requests[i % n]
            alone.ttft_alone += asyncio.run(engine_alone(engine, tokenizer, [req], first_text=True))[2]
            lone += asyncio.run(through_gateway(url, key, [i % n], max_tokens, f"a{i}"))[1]
        pipe.ttft_alone += [a.ttft_s for a in lone]
    finally:
        stack.stop_all()
    report(n, max_tokens, rounds, n_alone, pipe, alone, hops(kafka, lone))


def report(n: int, max_tokens: int, rounds: int, n_alone: int, pipe: Side, alone: Side,
           lone_hops: dict[str, list[float]]) -> None:
    ms = lambda s: s * 1000
    added = [ms(p - e) for p, e in zip(pipe.ttft_alone, alone.ttft_alone)]
    same = "same" if pipe.prompt_tokens == alone.prompt_tokens else "DIFFERENT"
    print(f"\n{n} requests at once x max {max_tokens} tokens, greedy; engine max_batch {ENGINE['max_batch']}, "
          f"KV {ENGINE['kv_cache_tokens']} tokens, context {ENGINE['max_seq_len']}, {ENGINE['num_threads']} threads; "
          f"{rounds} alternating rounds per side (best compared)")
    print(f"prompt tokens of the {n} requests: pipeline {sum(pipe.prompt_tokens)} / engine {sum(alone.prompt_tokens)} "
          f"({same} per request); completion tokens per round: pipeline {pipe.tokens} / engine {alone.tokens}")
    rows = [
        ("tokens/s (best round)", f"{max(alone.rates):.1f}", f"{max(pipe.rates):.1f}",
         f"x{max(pipe.rates) / max(alone.rates):.2f}"),
        ("tokens/s (rounds)", ", ".join(f"{r:.1f}" for r in alone.rates), ", ".join(f"{r:.1f}" for r in pipe.rates), ""),
        (f"TTFT p50, {n} at once (ms)", f"{ms(statistics.median(alone.ttft_load)):.0f}",
         f"{ms(statistics.median(pipe.ttft_load)):.0f}", ""),
        (f"TTFT p99, {n} at once (ms)", f"{ms(percentile(alone.ttft_load, 0.99)):.0f}",
         f"{ms(percentile(pipe.ttft_load, 0.99)):.0f}", ""),
        (f"TTFT p50, alone x{n_alone} (ms)", f"{ms(statistics.median(alone.ttft_alone)):.1f}",
         f"{ms(statistics.median(pipe.ttft_alone)):.1f}", f"+{percentile(added, 0.5):.1f} ms (paired p50)"),
        (f"TTFT p99, alone x{n_alone} (ms)", f"{ms(percentile(alone.ttft_alone, 0.99)):.1f}",
         f"{ms(percentile(pipe.ttft_alone, 0.99)):.1f}", f"+{percentile(added, 0.99):.1f} ms (paired p99)"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'':{width}}  {'engine alone':>16}  {'gateway+kafka+streams+worker':>28}  added / ratio")
    for name, a, p, extra in rows:
        print(f"{name:{width}}  {a:>16}  {p:>28}  {extra}")
    if pipe.cpu:
        median_cpu = lambda side, name: statistics.median(c[name] for c in side.cpu if name in c)
        print("CPU seconds per round beside the inference worker, median (pipeline round / engine-alone round): " +
              ", ".join(f"{name} {median_cpu(pipe, name):.2f}" + (f" / {median_cpu(alone, name):.2f}"
                                                                   if name in alone.cpu[0] else "")
                        for name in pipe.cpu[0]) +
              f"; a pipeline round took {statistics.median(t / r for t, r in zip(pipe.tokens, pipe.rates)):.2f} s "
              "(median)")
    if lone_hops["gateway"]:
        print(f"a lone prompt's time to first token through the pipeline, p50 of {len(lone_hops['gateway'])} (ms): " +
              ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in lone_hops.items()) +
              "  (gateway: HTTP in -> chat.prompts; streams: -> InferenceRequest produced; to worker: -> taken; "
              "worker: -> first chunk produced; back: -> client)")
    print(f"e2e/gateway+kafka+streams+worker vs engine tokens/s ratio = {max(pipe.rates) / max(alone.rates):.2f}")


if __name__ == "__main__":
    main()
