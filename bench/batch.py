"""The Batch API on a running pipeline: a batch's throughput against the same requests sent at once through
chat completions, and interactive time to first token while a batch runs against without one.

A whole pipeline (Kafka, ``chatpipe streams``, an inference worker with the default model, a gateway whose
runner runs the batch) as the gateway tests start it. Measured, in this order:

1. **Chat completions, concurrently** (the baseline): N greedy requests of ``max_tokens`` M sent by as many
   clients at once as the gateway's runner runs batch lines (``batch_concurrency``, 16), non-streamed,
   memory off (``X-Chatpipe-Memory: off``, as a batch line that names no conversation): output tokens / s
   from the first request sent to the last answer.
2. **The same N requests as one batch** (the official ``openai`` client: upload, create, poll every 0.2 s):
   output tokens / s from ``batches.create`` to the status ``completed`` (the output file written).
   The headline is 2 / 1 (goal >= 0.9: what the Batch API's queueing, storing each answer and writing the
   files costs, next to clients that hold their own connections).
3. **Interactive TTFT without and with a batch**: K streamed interactive requests one after another
   (M' tokens), first alone, then while a batch of B lines runs (the batch class: it fills the slots the
   interactive traffic leaves and yields to it, docs/worker.md); p50 and p90 TTFT of each, and their ratio
   (goal <= 1.5).

Starts its own broker (bench/local_broker.py) unless ``--bootstrap-servers`` is given. The last line is the
headline: ``batch/concurrent chat completions throughput ratio = X``.

    python bench/batch.py --quick     # about a minute on 2 CPU cores (plus the services' start)
    python bench/batch.py             # the docs/benchmarks.md figures
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from local_broker import bench_broker, bench_parser, fresh_kafka, percentile  # bench/, beside this script

MODEL = "smollm2-135m-instruct"
CONTEXT_TOKENS = 1024
ENGINE = {"max_batch": 8, "kv_cache_tokens": 8 * CONTEXT_TOKENS, "max_seq_len": CONTEXT_TOKENS, "num_threads": 2}
TOPICS = ["the sea", "a city at night", "autumn leaves", "a train journey", "a quiet library", "mountain air",
          "a busy market", "the first snow", "an old clock", "a summer storm", "a lighthouse", "a desert road"]


def body(i: int, max_tokens: int) -> dict:
    return {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": f"Write two sentences about {TOPICS[i % len(TOPICS)]} ({i})."}]}


async def concurrent(url: str, key: str, n: int, max_tokens: int, clients: int) -> tuple[float, int]:
    """Wall seconds and output tokens of ``n`` chat completions, ``clients`` in flight at once."""
    import httpx

    gate = asyncio.Semaphore(clients)
    headers = {"Authorization": f"Bearer {key}", "X-Chatpipe-Memory": "off"}

    async def one(http, i: int) -> int:
        async with gate:
            response = await http.post(f"{url}/v1/chat/completions", json=body(i, max_tokens), headers=headers)
        if response.status_code != 200:
            raise SystemExit(f"gateway answered {response.status_code}: {response.text[:300]}")
        return response.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients + 4), timeout=httpx.Timeout(900)) as http:
        began = time.perf_counter()
        tokens = await asyncio.gather(*(one(http, i) for i in range(n)))
        return time.perf_counter() - began, sum(tokens)


def start_batch(client, n: int, max_tokens: int, tag: str):
    lines = "".join(json.dumps({"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": body(i, max_tokens)}) + "\n" for i in range(n)).encode()
    upload = client.files.create(file=(f"{tag}.jsonl", lines), purpose="batch")
    return client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")


def wait_batch(client, batch_id: str, timeout_s: float = 3600):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.2)
    raise SystemExit(f"batch {batch_id} not done in {timeout_s} s")


def ttfts(url: str, key: str, k: int, max_tokens: int) -> list[float]:
    """TTFT of ``k`` streamed interactive requests, one after another."""
    import httpx

    out = []
    with httpx.Client(timeout=600) as http:
        for i in range(k):
            sent, first = time.perf_counter(), None
            with http.stream("POST", f"{url}/v1/chat/completions", json={**body(1000 + i, max_tokens), "stream": True},
                             headers={"Authorization": f"Bearer {key}", "X-Chatpipe-Memory": "off"}) as response:
                for line in response.iter_lines():
                    if first is None and line.startswith("data: ") and '"content":"' in line.replace(" ", "") \
                            and '"content":""' not in line.replace(" ", ""):
                        first = time.perf_counter()
            out.append((first or time.perf_counter()) - sent)
            time.sleep(0.3)
    return out


def main() -> None:
    parser = bench_parser(__doc__, "about a minute on 2 cores (32 requests of 16 tokens; 12 TTFT probes)")
    args = parser.parse_args()
    n, max_tokens, k, probe_tokens = (32, 16, 12, 8) if args.quick else (128, 32, 40, 8)
    import openai

    from chatpipe.testing.gateway import API_KEY, start_pipeline
    from gateway.settings import GatewaySettings

    clients = GatewaySettings.model_fields["batch_concurrency"].default
    root = Path(tempfile.mkdtemp(prefix="chatpipe-bench-batch-"))
    with bench_broker(args.bootstrap_servers, prefix="chatpipe-bench-batch-") as bootstrap:
        kafka = fresh_kafka(bootstrap, "bb")
        worker_env = {f"CHATPIPE_{k.upper()}": str(v) for k, v in {"device": "cpu", **ENGINE}.items()}
        started = time.perf_counter()
        stack = start_pipeline(kafka, root, tracing=False, worker_env=worker_env)
        print(f"pipeline up in {time.perf_counter() - started:.0f} s (logs in {root})")
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=API_KEY, max_retries=2, timeout=120)
        try:
            asyncio.run(concurrent(stack.url, API_KEY, 4, 4, 4))  # warm up: the model's first steps
            base_s, base_tokens = asyncio.run(concurrent(stack.url, API_KEY, n, max_tokens, clients))
            began = time.perf_counter()
            batch = start_batch(client, n, max_tokens, "throughput")
            done = wait_batch(client, batch.id)
            batch_s = time.perf_counter() - began
            if done.status != "completed" or done.request_counts.completed != n:
                raise SystemExit(f"the batch ended {done.status}: {done.request_counts}")
            alone = ttfts(stack.url, API_KEY, k, probe_tokens)
            background = start_batch(client, 4 * n, max_tokens, "background")
            time.sleep(3.0)  # its lines fill the worker
            during = ttfts(stack.url, API_KEY, k, probe_tokens)
            still = client.batches.retrieve(background.id)
            client.batches.cancel(background.id)
        finally:
            stack.stop_all()
    base_rate, batch_rate = base_tokens / base_s, done.usage.output_tokens / batch_s
    print(f"\n{n} greedy requests, max {max_tokens} tokens, model {MODEL}, engine max_batch {ENGINE['max_batch']}")
    print(f"chat completions, {clients} at once: {base_s:6.1f} s, {base_tokens} tokens, {base_rate:6.1f} tokens/s")
    print(f"one batch (create -> completed): {batch_s:6.1f} s, {done.usage.output_tokens} tokens, "
          f"{batch_rate:6.1f} tokens/s")
    ms = lambda xs, q: 1000 * percentile(xs, q)
    print(f"interactive TTFT alone:        p50 {ms(alone, 0.5):7.1f} ms  p90 {ms(alone, 0.9):7.1f} ms  ({k} requests)")
    print(f"interactive TTFT with a batch: p50 {ms(during, 0.5):7.1f} ms  p90 {ms(during, 0.9):7.1f} ms  "
          f"(the batch {still.status}, {still.request_counts.completed} of {4 * n} lines done at the last probe)")
    print(f"interactive p50 TTFT with/without a batch = {ms(during, 0.5) / ms(alone, 0.5):.2f} (goal <= 1.5)")
    print(f"batch/concurrent chat completions throughput ratio = {batch_rate / base_rate:.3f}")


if __name__ == "__main__":
    main()
