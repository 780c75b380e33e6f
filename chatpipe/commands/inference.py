"""``chatpipe inference``: run one inference worker (requests from Kafka, answers back to Kafka).

Builds ``KafkaSettings``, ``WorkerSettings`` and ``EngineSettings`` from flags and ``CHATPIPE_*``
variables, loads the model, and runs ``inference.worker.Worker`` until SIGTERM / SIGINT.
"""

from __future__ import annotations

import logging
import os
from typing import Annotated, Optional

import typer

from chatpipe.commands.common import build_settings, check_kafka, print_error, run_with_tcmalloc, with_kafka_flags
from chatpipe.commands.engine import Device, KvCacheTokens, MaxBatch, MaxSeqLen, Model
from chatpipe.options import option
from inference.worker.settings import WorkerSettings  # pydantic only: the flags are made from its fields
from transport.settings import KafkaSettings


@with_kafka_flags
def inference(
    engine: Annotated[Optional[str], option(WorkerSettings, "engine")] = None,
    intake: Annotated[Optional[str], option(WorkerSettings, "intake")] = None,
    kafka: Optional[KafkaSettings] = None,  # from --bootstrap-servers, --topic-prefix, --kafka-* (with_kafka_flags)
    group_id: Annotated[Optional[str], option(WorkerSettings, "group_id")] = None,
    worker_id: Annotated[Optional[str], option(WorkerSettings, "worker_id")] = None,
    max_in_flight: Annotated[Optional[int], option(WorkerSettings, "max_in_flight")] = None,
    metrics_port: Annotated[Optional[int], option(WorkerSettings, "metrics_port")] = None,
    grace_s: Annotated[Optional[float], option(WorkerSettings, "grace_s")] = None,
    model: Model = None,
    device: Device = None,
    max_batch: MaxBatch = None,
    kv_cache_tokens: KvCacheTokens = None,
    max_seq_len: MaxSeqLen = None,
    log_level: Annotated[str, typer.Option("--log-level", help="DEBUG, INFO, WARNING")] = "INFO",
) -> None:
    """Serve InferenceRequests from Kafka with the local engine until SIGTERM."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # for huggingface_hub, which reads it: models from local folders only
    import asyncio
    import signal

    from inference.engine.errors import EngineError
    from inference.engine.settings import DEFAULT_MODEL_NAME, EngineSettings
    from inference.worker.worker import Worker
    from transport import spans
    from transport.logs import configure_logging

    configure_logging("inference", log_level)  # CHATPIPE_LOG_FORMAT: text or JSON lines
    worker_settings = build_settings(WorkerSettings, engine=engine, intake=intake, group_id=group_id,
                                     worker_id=worker_id, max_in_flight=max_in_flight, metrics_port=metrics_port,
                                     grace_s=grace_s)
    engine_settings = build_settings(EngineSettings, model_path=model, device=device, max_batch=max_batch,
                                     kv_cache_tokens=kv_cache_tokens, max_seq_len=max_seq_len)
    if worker_settings.engine != "vllm":  # before torch loads: our engine runs with tcmalloc (infra/allocator.py)
        run_with_tcmalloc(engine_settings.allocator)
    chosen = choose_engine(worker_settings.engine, engine_settings)
    if chosen == "vllm":
        run_in_vllm_env(engine_settings)  # returns only in the vLLM environment itself
    check_kafka(kafka, "inference")  # before the model loads: a refused password says so in seconds
    try:
        the_engine, tokenizer, constraints = build_engine(chosen, engine_settings)
    except EngineError as exc:
        print_error(exc)
        raise typer.Exit(1) from None
    logging.getLogger("chatpipe.inference").info("engine: %s (--engine %s)", chosen, worker_settings.engine)
    model_name = str(engine_settings.model_path) if engine_settings.model_path else DEFAULT_MODEL_NAME
    worker = Worker(kafka, worker_settings, the_engine, tokenizer, model_name, constraints=constraints)

    async def main() -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.request_stop)
        return await worker.run()

    spans.configure("inference")  # CHATPIPE_TRACING_*: where spans go (docs/observability.md)
    try:
        code = asyncio.run(main())
    finally:
        spans.shutdown()  # export what is left
    raise typer.Exit(code)


def choose_engine(choice: str, engine_settings) -> str:
    """``auto``: vLLM on a CUDA device when its environment is made (or vLLM is importable here), else ours."""
    if choice != "auto":
        return choice
    if not engine_settings.resolved_device().startswith("cuda"):
        return "chatpipe"
    from infra.vllm_env import vllm_env, vllm_importable

    return "vllm" if vllm_importable() or vllm_env().ready else "chatpipe"


def run_in_vllm_env(engine_settings) -> None:
    """Run this same command with the vLLM environment's Python (``infra/vllm_env.py``), unless this
    process is that one already. Exits 1 naming `make setup-vllm` when the environment is not made."""
    import sys

    from infra.vllm_env import VllmEnvMissing, exec_in_vllm_env, vllm_importable

    if vllm_importable():
        return
    try:
        exec_in_vllm_env(["-m", "chatpipe.cli", *sys.argv[1:]], engine_settings.num_threads)
    except VllmEnvMissing as exc:
        print_error(exc)
        raise typer.Exit(1) from None


def build_engine(chosen: str, engine_settings):
    """(engine, tokenizer, constraints or None) of the chosen engine; raises ``EngineError``."""
    from inference.engine.model_store import load_model, load_tokenizer, locate_model

    if chosen == "vllm":
        from inference.vllm_engine.constraints import VllmConstraints
        from inference.vllm_engine.engine import VllmEngine
        from inference.worker.errors import InvalidRequestError

        location = locate_model(engine_settings)
        if location.gguf_file:
            from inference.engine.errors import ModelLoadError

            raise ModelLoadError(f"{location.describe()}: the vLLM engine serves Hugging Face model folders; "
                                 "`chatpipe model pull` converts the default model to one")
        return (VllmEngine(location.folder, engine_settings), load_tokenizer(location),
                VllmConstraints(InvalidRequestError))
    from inference.engine.engine import Engine

    lm, tokenizer = load_model(engine_settings)
    return Engine(lm, engine_settings), tokenizer, None


def register(app: typer.Typer) -> None:
    app.command("inference")(inference)
