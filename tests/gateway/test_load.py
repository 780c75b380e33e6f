"""Load on loopback: 64 concurrent streaming clients for 60 s through the whole pipeline.

Guards against what only shows under sustained concurrency: a request that never finishes (a
lost reply, a leaked pending slot, a stream without ``[DONE]``), an overload answered with
anything but 429 + Retry-After in OpenAI's error shape, and memory that grows with the number of
requests served (per-request state kept after the request ended) in any service process.

Real processes throughout (the ``pipeline`` fixture: streams, inference worker with the default
model, gateway with its default admission: by estimated wait) on the session broker; the clients are
asyncio + httpx in this process. Everything is bounded: each client stops starting requests
after ``DURATION_S``, each request has a client-side deadline, and the whole run has a hard one.
The printed report (TTFT, tokens/s, outcomes, memory per service) is the figure of
docs/gateway_load.md; nothing here asserts a speed (speed is bench/e2e.py's job).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from chatpipe.testing.gateway import API_KEY

pytestmark = [pytest.mark.integration, pytest.mark.model]
MODEL = "smollm2-135m-instruct"
AUTH = {"Authorization": f"Bearer {API_KEY}"}

CLIENTS = 64
DURATION_S = 60.0  # clients start new requests until then
# One request, client side, sent -> [DONE]: first tokens came up to 113 s late on a loaded 2-core box.
REQUEST_TIMEOUT_S = 180.0
HARD_DEADLINE_S = DURATION_S + REQUEST_TIMEOUT_S + 20  # every client task must have ended by then
MAX_BACKOFF_S = 5.0  # a 429's Retry-After is honoured up to this
WARMUP_S = 15.0  # memory baseline: the first sample after this (model, caches, clients all warm)
SAMPLE_EVERY_S = 1.0
# Allowed RSS growth of each service from its warm baseline to the end of the run (MiB). What a request
# holds is bounded by the gateway's 32 in flight and the worker's batch of 8 (its KV cache is allocated
# up front), so a leak of per-request state shows as growth proportional to the ~50-400 requests of a run.
# gateway: measured +0.1 MiB; 32 covers Python's arenas. inference: measured +0.2..13 MiB (prefills of new
# lengths); 128 covers torch's allocator. streams: its bfloat16 embedding model keeps per-shape caches
# (oneDNN primitives and allocator arenas): embedding batches of new (batch, length) shapes alone took
# its RSS from 1024 to 1627 MiB over 1200 batches, levelling off (+6 MiB per 100 batches at the end);
# float32 levels off at +133 MiB. A run here embeds at most a few hundred batches, so 768 bounds that and
# still catches a leak of a few MiB per request (a kept context, batch or stream).
GROWTH_LIMIT_MIB = {"gateway": 32.0, "inference": 128.0, "streams": 768.0}
PROMPTS = ["Say hello.", "Name a fruit.", "What is two plus two?", "Name a colour.", "Tell me a short joke.",
           "What is the capital of France?", "Count to five.", "Name an animal that swims.",
           "Give me a word that rhymes with cat.", "What day comes after Monday?"]


@dataclass
class Outcomes:
    completed: int = 0
    busy: int = 0  # 429
    errors: list[str] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    slowest: list[tuple[float, float, str]] = field(default_factory=list)  # (ttft, sent at, request id)
    started: float = field(default_factory=time.perf_counter)
    tokens_out: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)


def check_busy(response: httpx.Response, body: bytes) -> str | None:
    """What is wrong with a 429 (None when it is Retry-After + OpenAI's error shape)."""
    retry = response.headers.get("Retry-After", "")
    if not retry.isdigit() or int(retry) < 1:
        return f"429 without a usable Retry-After: {retry!r}"
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return f"429 body is not OpenAI's error shape: {body[:200]!r}"
    if not isinstance(error.get("message"), str) or error.get("type") != "rate_limit_error" \
            or not {"param", "code"} <= error.keys():
        return f"429 error body lacks OpenAI's fields: {error}"
    return None


async def read_stream(response: httpx.Response, sent: float, max_tokens: int, out: Outcomes) -> None:
    """A 200 stream: chunks until [DONE]; records TTFT and tokens, or the error."""
    first_token_at, finish, usage, done = None, None, None, False
    async for line in response.aiter_lines():
        if not line:
            continue
        if not line.startswith("data: "):
            out.errors.append(f"not an SSE data line: {line[:120]!r}")
            return
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            break
        event = json.loads(data)
        if "error" in event:
            out.errors.append(f"error event mid-stream: {event['error']}")
            return
        if event.get("usage"):
            usage = event["usage"]
        for choice in event.get("choices", []):
            if choice["delta"].get("content") and first_token_at is None:
                first_token_at = time.perf_counter()
            finish = choice.get("finish_reason") or finish
    if not done or finish not in ("stop", "length") or usage is None:
        out.errors.append(f"stream ended without [DONE]/finish_reason/usage: done={done} finish={finish} usage={usage}")
        return
    if not 1 <= usage["completion_tokens"] <= max_tokens:
        out.errors.append(f"completion_tokens {usage['completion_tokens']} outside 1..{max_tokens}")
        return
    out.completed += 1
    out.tokens_out += usage["completion_tokens"]
    out.finish_reasons[finish] = out.finish_reasons.get(finish, 0) + 1
    if first_token_at is not None:  # an answer that is only an end-of-sequence token has no text at all
        out.ttft_s.append(first_token_at - sent)
        request_id = response.headers.get("X-Chatpipe-Request-Id", "?")
        out.slowest = sorted([*out.slowest, (first_token_at - sent, sent, request_id)], reverse=True)[:5]


async def one_request(http: httpx.AsyncClient, url: str, rng: random.Random, client: int, conversation: str,
                      out: Outcomes) -> float:
    """One streamed request; returns how long to back off before the next (0 unless 429)."""
    max_tokens = rng.randint(16, 32)
    body = {"model": MODEL, "stream": True, "max_tokens": max_tokens, "temperature": 0.7,
            "messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "user": f"load-client-{client}",
            "stream_options": {"include_usage": True}}
    headers = {**AUTH, "X-Chatpipe-Conversation-Id": conversation}
    sent = time.perf_counter()
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            async with http.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as response:
                if response.status_code == 429:
                    problem = check_busy(response, await response.aread())
                    if problem:
                        out.errors.append(problem)
                        return 0.0
                    out.busy += 1
                    return min(MAX_BACKOFF_S, float(response.headers["Retry-After"]))
                if response.status_code != 200:
                    out.errors.append(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
                    return 0.0
                await read_stream(response, sent, max_tokens, out)
    except TimeoutError:
        out.errors.append(f"client {client}: no complete answer within {REQUEST_TIMEOUT_S:.0f} s")
    except httpx.HTTPError as exc:
        out.errors.append(f"client {client}: {type(exc).__name__}: {exc}")
    return 0.0


async def client_loop(http: httpx.AsyncClient, url: str, client: int, stop_at: float, out: Outcomes) -> None:
    """One user chatting in one conversation (its history and memory recall are in every context;
    a fixed set of conversations keeps the streams tier's per-conversation state bounded, so
    memory growth there means a leak, not more conversations)."""
    rng = random.Random(client)
    conversation = f"load-{uuid.uuid4().hex[:8]}-{client}"
    while time.monotonic() < stop_at:
        backoff = await one_request(http, url, rng, client, conversation, out)
        if backoff:
            await asyncio.sleep(min(backoff, max(0.0, stop_at - time.monotonic())))


def tree_rss_mib(pid: int) -> float:
    """RSS of a process and its descendants (VmRSS from /proc), MiB; 0 when it is gone."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")) / 1024
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
        except (OSError, StopIteration):
            continue
    return total


async def sample_memory(pids: dict[str, int], samples: dict[str, list[tuple[float, float]]], start: float,
                        stop: asyncio.Event) -> None:
    while not stop.is_set():
        now = time.monotonic() - start
        for name, pid in pids.items():
            samples[name].append((now, tree_rss_mib(pid)))
        try:
            await asyncio.wait_for(stop.wait(), SAMPLE_EVERY_S)
        except TimeoutError:
            pass


async def run_load(url: str, pids: dict[str, int]) -> tuple[Outcomes, float, list[str], dict]:
    out = Outcomes()
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in pids}
    start = time.monotonic()
    stop_sampling = asyncio.Event()
    sampler = asyncio.create_task(sample_memory(pids, samples, start, stop_sampling))
    limits = httpx.Limits(max_connections=CLIENTS + 8, max_keepalive_connections=CLIENTS + 8)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(REQUEST_TIMEOUT_S)) as http:
        tasks = [asyncio.create_task(client_loop(http, url, i, start + DURATION_S, out)) for i in range(CLIENTS)]
        _, hung = await asyncio.wait(tasks, timeout=HARD_DEADLINE_S)
        for task in hung:
            task.cancel()
        await asyncio.gather(*hung, return_exceptions=True)
    elapsed = time.monotonic() - start
    stop_sampling.set()
    await sampler
    crashed = [f"client task raised {t.exception()!r}" for t in tasks if t.done() and not t.cancelled() and t.exception()]
    return out, elapsed, [f"{len(hung)} client task(s) still running at the hard deadline"] * bool(hung) + crashed, samples


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def test_64_streaming_clients_for_60s_all_complete_or_get_429_and_memory_stays_bounded(pipeline, capsys):
    """64 clients, each streaming requests back to back for 60 s (short prompts, 16-32 tokens,
    temperature 0.7; 429s back off per Retry-After): every request ends in a complete stream
    (finish_reason, usage, [DONE]) or a proper 429; no client hangs past the deadline; the gateway
    has nothing pending afterwards; every service's RSS grows from its warm baseline by less than
    its GROWTH_LIMIT_MIB."""
    pids = {"streams": pipeline.streams.proc.pid, "inference": pipeline.worker.proc.pid,
            "gateway": pipeline.gateway.proc.pid}
    out, elapsed, hangs, samples = asyncio.run(run_load(pipeline.url, pids))

    pending, deadline = None, time.monotonic() + 10
    while time.monotonic() < deadline:
        pending = httpx.get(f"{pipeline.url}/healthz", timeout=5).json()["pending"]
        if pending == 0:
            break
        time.sleep(0.2)
    alive = {name: proc.poll() is None for name, proc in (("streams", pipeline.streams.proc),
                                                          ("inference", pipeline.worker.proc),
                                                          ("gateway", pipeline.gateway.proc))}

    memory = {}
    for name, series in samples.items():
        warm = next((rss for t, rss in series if t >= WARMUP_S), series[0][1])
        memory[name] = (series[0][1], warm, max(rss for _, rss in series), series[-1][1])
    lines = [f"load: {CLIENTS} streaming clients x {DURATION_S:.0f} s on loopback, whole run {elapsed:.1f} s",
             f"  completed {out.completed} (finish {out.finish_reasons}), 429 {out.busy}, errors {len(out.errors)}",
             f"  tokens/s overall {out.tokens_out / elapsed:.1f} ({out.tokens_out} completion tokens / {elapsed:.1f} s)"]
    if out.ttft_s:
        lines.append(f"  TTFT (client: sent -> first content token) p50 {statistics.median(out.ttft_s) * 1000:.0f} ms, "
                     f"p99 {pct(out.ttft_s, 0.99) * 1000:.0f} ms, max {max(out.ttft_s) * 1000:.0f} ms")
        lines.append("  slowest first tokens (s; sent at s into the run; request id): " + ", ".join(
            f"{ttft:.1f}; {sent - out.started:.1f}; {rid}" for ttft, sent, rid in out.slowest))
    lines.append(f"  RSS MiB per service (start / warm at {WARMUP_S:.0f} s / peak / end; growth warm->end):")
    for name, (first, warm, peak, end) in memory.items():
        lines.append(f"    {name:9} {first:7.1f} / {warm:7.1f} / {peak:7.1f} / {end:7.1f}; {end - warm:+.1f}")
    for name, series in samples.items():
        every_10s = {int(t // 10) * 10: rss for t, rss in reversed(series)}
        lines.append(f"    {name:9} every 10 s: " + " ".join(f"{rss:.0f}" for _, rss in sorted(every_10s.items())))
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    report = "\n".join(lines)

    assert not hangs, f"{hangs}\n{report}"
    assert not out.errors, f"{len(out.errors)} request(s) neither completed nor got 429, first: {out.errors[:5]}\n{report}"
    # Admission by estimated wait (gateway/admission.py): 64 clients' first tokens fit the 300 s deadline,
    # so every client's requests are taken, and every admitted request must complete (no errors above).
    assert out.completed >= CLIENTS, f"fewer requests completed than there are clients\n{report}"
    assert pending == 0, f"the gateway still has {pending} request(s) pending after every client ended\n{report}"
    assert all(alive.values()), f"a service died under load: {alive}\n{report}"
    grown = {name: round(end - warm, 1) for name, (_, warm, _, end) in memory.items()
             if end - warm > GROWTH_LIMIT_MIB[name]}
    assert not grown, f"RSS grew more than {GROWTH_LIMIT_MIB} MiB from warm-up to the end: {grown}\n{report}"
