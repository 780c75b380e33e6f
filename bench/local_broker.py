"""What the Kafka benchmarks share: the broker a benchmark runs against (the one given, or the
project's own local Kafka started on free ports in a temporary folder and stopped afterwards), its
pid, topics of a run's own, a process's CPU time, the common arguments, the engine-alone baseline of
bench/worker.py and bench/e2e.py, and a percentile."""

from __future__ import annotations

import argparse
import sys
import asyncio
import gc
import os
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from chatpipe.testing.ports import free_port


@contextmanager
def bench_broker(bootstrap: str | None, prefix: str = "chatpipe-bench-") -> Iterator[str]:
    """Yields bootstrap servers: ``bootstrap`` when given, else those of a broker started here."""
    if bootstrap is not None:
        yield bootstrap
        return
    from infra.local_kafka import LocalKafka
    from infra.settings import StackSettings

    kafka = LocalKafka(StackSettings(state_dir=tempfile.mkdtemp(prefix=prefix),
                                     kafka_port=free_port(), controller_port=free_port()))
    kafka.up()
    try:
        yield kafka.settings.bootstrap_servers
    finally:
        gc.collect()  # close leftover clients before the broker goes, to keep their logs quiet
        kafka.down()


def fresh_kafka(bootstrap: str, tag: str = "b"):
    """KafkaSettings of ``bootstrap`` under a topic prefix of its own (``<tag><random>.``), with
    every catalog topic created: a run that sees no other run's records."""
    from transport.admin import TopicAdmin
    from transport.settings import KafkaSettings

    kafka = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=f"{tag}{uuid.uuid4().hex[:8]}.")
    TopicAdmin(kafka).apply()
    return kafka


def bench_parser(doc: str, quick_help: str) -> argparse.ArgumentParser:
    """A benchmark's parser: its docstring as the description, ``--quick`` and ``--bootstrap-servers``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--bootstrap-servers", default=None, help="use this broker instead of starting one")
    return parser


def add_engine_arg(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--engine", choices=["chatpipe", "vllm"], default="chatpipe",
                        help=f"{what} (vllm: vLLM's engine; the bench then runs in the vLLM environment, "
                             "infra/vllm_env.py, `make setup-vllm`)")


def enter_engine_env(engine: str, script: str, num_threads: int | None) -> None:
    """With ``--engine vllm``, run this bench again with the vLLM environment's Python (vLLM pins its
    own torch); returns only in a process that can import vLLM. With ``--engine chatpipe``, run it
    again with tcmalloc preloaded and 2 MB pages, as ``chatpipe inference`` runs our engine
    (infra/allocator.py)."""
    if engine != "vllm":
        from infra.allocator import run_with_tcmalloc
        from inference.engine.settings import EngineSettings

        run_with_tcmalloc([script, *sys.argv[1:]], EngineSettings().allocator)
        return
    from infra.vllm_env import exec_in_vllm_env, vllm_importable

    if not vllm_importable():
        exec_in_vllm_env([script, *sys.argv[1:]], num_threads)


def load_engine(name: str, settings):
    """(engine, tokenizer) of ``settings``: ours, or vLLM's behind the same surface (``--engine vllm``)."""
    if name == "vllm":
        from inference.engine.model_store import load_tokenizer, locate_model
        from inference.vllm_engine.engine import VllmEngine

        location = locate_model(settings)
        return VllmEngine(location.folder, settings), load_tokenizer(location)
    from inference.engine.engine import Engine
    from inference.engine.model_store import load_model

    model, tokenizer = load_model(settings)
    return Engine(model, settings), tokenizer


def broker_pid(bootstrap: str) -> int | None:
    """The local broker's pid (the java process listening on the bootstrap port), for its CPU time."""
    port = bootstrap.rsplit(":", 1)[-1]
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:  # an OSError: the process ended, or is not ours to read
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if "kafka.Kafka" not in cmd:
                continue
            props = Path(cmd.split()[-1])
            if not props.is_absolute():
                props = Path(os.readlink(proc / "cwd")) / props
            if f":{port}" in props.read_text():
                return int(proc.name)
        except OSError:
            continue
    return None


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (its threads included); nan when it is not there."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def cpu_of(pids: dict[str, int]) -> dict[str, float]:
    """``cpu_s`` of each named process."""
    return {name: cpu_s(pid) for name, pid in pids.items()}


def cpu_since(pids: dict[str, int], before: dict[str, float]) -> dict[str, float]:
    """CPU seconds each named process used since ``before`` (a ``cpu_of``)."""
    return {name: cpu_s(pid) - before[name] for name, pid in pids.items()}


async def engine_alone(engine, tokenizer, requests: list, *, first_text: bool = False
                       ) -> tuple[float, list[int], list[float], list[int]]:
    """(seconds, then per request: output tokens, TTFT, prompt tokens) of ``requests`` submitted at once to
    the engine alone in this process, with the inference worker's text deltas (``AsyncEngine``,
    ``Generation``), no Kafka. TTFT to the first token (when the worker would send its first chunk), or
    with ``first_text`` to the first text (when the gateway's client sees its first content)."""
    from inference.engine.streaming import AsyncEngine
    from inference.worker.generation import Generation
    from inference.worker.prompts import prepare

    async with AsyncEngine(engine, idle_wait_s=0.01) as aengine:
        async def one(req) -> tuple[int, float, int]:
            t0, first = time.perf_counter(), []
            prepared = prepare(req, tokenizer, engine.settings.max_seq_len)
            on_first_token = (lambda: None) if first_text else (lambda: first.append(time.perf_counter()))
            gen = Generation(aengine, tokenizer, f"{req.request_id}-{uuid.uuid4().hex[:6]}", prepared, on_first_token)
            out = 0
            async for delta in gen.deltas():
                if first_text and not first and delta.text:
                    first.append(time.perf_counter())
                if delta.finished:
                    out = delta.num_output_tokens
            return out, (first[0] if first else time.perf_counter()) - t0, len(prepared.prompt_ids)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(r) for r in requests))
        elapsed = time.perf_counter() - start
    return elapsed, [r[0] for r in results], [r[1] for r in results], [r[2] for r in results]


def percentile(values: list[float], q: float) -> float:
    """The value at rank ``round(q * (n - 1))`` of the sorted values."""
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]
