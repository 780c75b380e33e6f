"""The response cache on a running stack: hit ratio, time to first token of hits vs misses, worker tokens saved.

A chat trace is replayed through the gateway of a whole pipeline (Kafka, ``chatpipe streams`` with a Redis
response cache, an inference worker with the default model, a gateway) by a few clients at once (streamed):

- **Trace shape** (stated, not measured from a real log: no trace can be downloaded here). Users of one
  tenant open new conversations with a first question drawn from a pool of FAQ-style questions with a
  Zipf popularity (s = 1.1): a few questions are asked by many users, most by few; the shape public chat
  logs show for first turns (LMSYS-Chat-1M: greetings and a handful of popular questions repeat across
  users, the long tail does not), greedy as an FAQ assistant is configured. A share of the requests
  (``--sampled``, 20%) is sampled (temperature 0.7, no seed) and bypasses the cache; a share
  (``--follow-ups``, 20%) is a second turn of an earlier conversation: its context holds the first turn
  (streams' table), so it hits only where another user had the same first turn and follow-up. Memory is
  on: a user's later conversations recall their earlier ones, which makes their contexts their own.
- **Measured**: per request the client-side time to the first content token and whether the gateway said
  ``X-Chatpipe-Cache: hit``. Hit ratio = hits / cacheable requests (greedy ones; the bypasses are counted
  apart); p50 and p99 TTFT of hits and of misses; the tokens the worker did not compute (the hits' prompt
  and completion tokens) and their rate over the run.

Starts its own broker (bench/local_broker.py) unless ``--bootstrap-servers`` is given, its own
``redis-server`` (chatpipe/testing/redis.py) and the pipeline as the gateway tests do
(chatpipe/testing/gateway.py). The last line is the headline: ``cache/hit vs miss p50 TTFT ratio = X``
(goal <= 0.2: a hit skips the worker).

    python bench/cache.py --quick     # about a minute on 2 CPU cores (plus the services' start)
    python bench/cache.py             # the docs/benchmarks.md figures
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from local_broker import bench_broker, bench_parser, fresh_kafka, percentile  # bench/, beside this script

MODEL = "smollm2-135m-instruct"
CONTEXT_TOKENS = 1024
ENGINE = {"max_batch": 8, "kv_cache_tokens": 8 * CONTEXT_TOKENS, "max_seq_len": CONTEXT_TOKENS, "num_threads": 2}
QUESTIONS = [
    "How do I reset my password?", "What are your opening hours?", "How can I cancel my subscription?",
    "Do you ship internationally?", "How do I change my email address?", "What payment methods do you accept?",
    "How long does delivery take?", "Can I return an item?", "How do I contact support?",
    "Is there a student discount?", "How do I update my billing address?", "Where is my order?",
    "Can I change my order after placing it?", "Do you have a mobile app?", "How do I delete my account?",
    "What is your refund policy?", "How do I track a package?", "Can I pay in instalments?",
    "Do you offer gift cards?", "How do I enable two-factor authentication?", "What does the premium plan include?",
    "How do I export my data?", "Why was my card declined?", "How do I add a team member?",
    "What are the system requirements?", "How do I change the language?", "Is my data encrypted?",
    "How do I report a bug?", "Can I use it offline?", "How do I upgrade my plan?",
]


@dataclass(frozen=True)
class Turn:
    user: str
    conversation: str
    messages: tuple[dict, ...]
    sampled: bool
    follow_up: bool = False  # a second turn: the conversation's first turn is in its context (streams' table)


@dataclass
class Answered:
    turn: Turn
    ttft_s: float
    hit: bool
    prompt_tokens: int
    completion_tokens: int
    text: str


def trace(n: int, users: int, sampled: float, follow_ups: float, seed: int = 7) -> list[Turn]:
    """The replayed requests (module docstring): Zipf first questions, some sampled, some second turns."""
    rng = random.Random(seed)
    weights = [1 / (rank + 1) ** 1.1 for rank in range(len(QUESTIONS))]
    turns: list[Turn] = []
    for i in range(n):
        user = f"u{rng.randrange(users)}"
        if turns and rng.random() < follow_ups:
            first = rng.choice([t for t in turns if not t.follow_up])
            turns.append(Turn(first.user, first.conversation, ({"role": "user", "content": "Say it more briefly."},),
                              first.sampled, follow_up=True))
            continue
        question = rng.choices(QUESTIONS, weights)[0]
        turns.append(Turn(user, f"c{i}", ({"role": "user", "content": question},), rng.random() < sampled))
    return turns


async def ask(http, url: str, key: str, turn: Turn, max_tokens: int, run: str) -> Answered:
    body = {"model": MODEL, "stream": True, "max_tokens": max_tokens, "messages": list(turn.messages),
            "user": f"{run}-{turn.user}", "stream_options": {"include_usage": True},
            "temperature": 0.7 if turn.sampled else 0}
    headers = {"Authorization": f"Bearer {key}", "X-Chatpipe-Conversation-Id": f"{run}-{turn.conversation}"}
    sent = time.perf_counter()
    first, usage, parts = None, None, []
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            raise SystemExit(f"gateway answered {response.status_code}: {(await response.aread())[:300]!r}")
        hit = response.headers.get("X-Chatpipe-Cache") == "hit"
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                if choice["delta"].get("content"):
                    first = first or time.perf_counter()
                    parts.append(choice["delta"]["content"])
    if usage is None:
        raise SystemExit("a stream ended without usage")
    return Answered(turn, (first or time.perf_counter()) - sent, hit, usage["prompt_tokens"],
                    usage["completion_tokens"], "".join(parts))


async def replay(url: str, key: str, turns: list[Turn], max_tokens: int, clients: int, run: str) -> list[Answered]:
    """``turns`` in order by ``clients`` at once; a follow-up waits for its conversation's first turn."""
    import httpx

    gate = asyncio.Semaphore(clients)
    done: dict[str, asyncio.Event] = {}

    async def one(http, turn: Turn) -> Answered:
        if turn.follow_up:
            await done[turn.conversation].wait()
        async with gate:
            answer = await ask(http, url, key, turn, max_tokens, run)
        done.setdefault(turn.conversation, asyncio.Event()).set()
        return answer

    for turn in turns:
        if not turn.follow_up:
            done.setdefault(turn.conversation, asyncio.Event())
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients + 4), timeout=httpx.Timeout(600)) as http:
        return list(await asyncio.gather(*(one(http, t) for t in turns)))


def main() -> None:
    parser = bench_parser(__doc__, "about a minute on 2 cores (40 requests, 16 tokens)")
    parser.add_argument("--sampled", type=float, default=0.2, help="share of sampled requests (bypass the cache)")
    parser.add_argument("--follow-ups", type=float, default=0.2, help="share of second turns")
    parser.add_argument("--clients", type=int, default=4, help="requests in flight at once")
    parser.add_argument("--streams-torch-threads", type=int, default=None,
                        help="CHATPIPE_STREAMS_TORCH_THREADS of the streams worker (default: torch's, all cores)")
    args = parser.parse_args()
    n, users, max_tokens = (40, 20, 16) if args.quick else (200, 80, 48)
    from chatpipe.testing.gateway import API_KEY, start_pipeline
    from chatpipe.testing.redis import RedisServer

    root = Path(tempfile.mkdtemp(prefix="chatpipe-bench-cache-"))
    with bench_broker(args.bootstrap_servers, prefix="chatpipe-bench-cache-") as bootstrap, RedisServer(root) as redis:
        kafka = fresh_kafka(bootstrap, "rc")
        worker_env = {f"CHATPIPE_{k.upper()}": str(v) for k, v in {"device": "cpu", **ENGINE}.items()}
        started = time.perf_counter()
        stack = start_pipeline(kafka, root, tracing=False, worker_env=worker_env,
                               streams_env={"CHATPIPE_CACHE_URL": redis.url, **(
                                   {"CHATPIPE_STREAMS_TORCH_THREADS": str(args.streams_torch_threads)}
                                   if args.streams_torch_threads else {})})
        print(f"pipeline with a response cache up in {time.perf_counter() - started:.0f} s (logs in {root})")
        try:
            warm = [Turn("w", f"w{i}", ({"role": "user", "content": f"Warm up {i}."},), True) for i in range(2)]
            asyncio.run(replay(stack.url, API_KEY, warm, 4, 2, "warm"))
            turns = trace(n, users, args.sampled, args.follow_ups)
            began = time.perf_counter()
            answers = asyncio.run(replay(stack.url, API_KEY, turns, max_tokens, args.clients, "run"))
            wall = time.perf_counter() - began
        finally:
            stack.stop_all()
    report(answers, wall, n, users, max_tokens, args)


def report(answers: list[Answered], wall: float, n: int, users: int, max_tokens: int, args) -> None:
    cacheable = [a for a in answers if not a.turn.sampled]
    hits = [a for a in cacheable if a.hit]
    misses = [a for a in cacheable if not a.hit]
    sampled = [a for a in answers if a.turn.sampled]
    if not hits or not misses:
        raise SystemExit(f"{len(hits)} hits and {len(misses)} misses: nothing to compare")
    def ms(xs: list[Answered], q: float) -> float:
        return 1000 * percentile([a.ttft_s for a in xs], q / 100)

    saved_tokens = sum(a.prompt_tokens + a.completion_tokens for a in hits)
    saved_out = sum(a.completion_tokens for a in hits)
    print(f"\n{n} requests ({len(cacheable)} greedy, {len(sampled)} sampled; {sum(a.turn.follow_up for a in answers)} "
          f"second turns) by {users} users of one tenant, {args.clients} at once, max {max_tokens} tokens, "
          f"{len(QUESTIONS)} FAQ questions with Zipf(1.1) popularity; {wall:.1f} s")
    print(f"hit ratio {len(hits) / len(cacheable):.0%} of cacheable requests ({len(hits)} of {len(cacheable)}); "
          f"sampled ones bypass (and none of them was a hit: {sum(a.hit for a in sampled)})")
    print(f"TTFT hits   p50 {ms(hits, 50):7.1f} ms  p99 {ms(hits, 99):7.1f} ms  ({len(hits)})")
    print(f"TTFT misses p50 {ms(misses, 50):7.1f} ms  p99 {ms(misses, 99):7.1f} ms  ({len(misses)})")
    print(f"worker tokens not computed: {saved_tokens} ({saved_out} generated, the rest prompt), "
          f"{saved_tokens / wall:.1f} tokens/s over the run ({saved_out / wall:.1f} generated tokens/s)")
    print(f"cache/hit vs miss p50 TTFT ratio = {ms(hits, 50) / ms(misses, 50):.3f}")


if __name__ == "__main__":
    main()
