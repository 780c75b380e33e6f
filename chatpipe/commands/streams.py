"""`chatpipe streams`: run the Faust worker (intake, record, forget, archive agents).

Builds ``KafkaSettings``, ``StreamsSettings`` and ``MemorySettings`` from flags and ``CHATPIPE_*``
variables, finds the chat model's tokenizer (the pulled default model unless
``CHATPIPE_STREAMS_TOKENIZER_PATH`` says otherwise) and runs until SIGTERM or Ctrl-C.

Exit codes, for the supervisor that restarts it: 0 after SIGTERM/Ctrl-C; 75 when Qdrant, the
broker or the archive's disk failed for longer than the retry budget (the batch in hand was not
acknowledged and is read again after the restart); 70 when an agent raised something unexpected
(a bug; its batch is not acknowledged either); 1 for a configuration error at start; 78 when the
broker refused the Kafka credentials or its certificate is not trusted (transport.connect_check).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from chatpipe.commands.common import with_kafka_flags
from chatpipe.options import option
from streams.cache_settings import CacheSettings  # pydantic only: the flags are made from its fields
from streams.memory_settings import MemorySettings  # pydantic only: the flags are made from its fields
from streams.settings import StreamsSettings
from transport.settings import KafkaSettings


@with_kafka_flags
def streams(
    kafka: Optional[KafkaSettings] = None,  # from --bootstrap-servers, --topic-prefix, --kafka-* (with_kafka_flags)
    state_dir: Annotated[Optional[Path], option(StreamsSettings, "state_dir")] = None,
    archive_dir: Annotated[Optional[Path], option(StreamsSettings, "archive_dir")] = None,
    memory_path: Annotated[Optional[Path], option(MemorySettings, "path", "--memory-path")] = None,
    qdrant_url: Annotated[Optional[str], option(MemorySettings, "url", "--qdrant-url")] = None,
    cache_url: Annotated[Optional[str], option(CacheSettings, "url", "--cache-url")] = None,
    tokenizer: Annotated[Optional[Path], option(StreamsSettings, "tokenizer_path", "--tokenizer")] = None,
    log_level: Annotated[Optional[str], option(StreamsSettings, "log_level")] = None,
    metrics_port: Annotated[Optional[int], option(StreamsSettings, "metrics_port")] = None,
) -> None:
    """Run the streams worker: prompts -> context -> inference requests; responses -> turns, memory, archive.

    Exits 75 when an outage outlasts the retry budget (restart it: nothing was acknowledged), 70 on a bug.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models come from local folders only
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # for tokenizers (read by it): no fork warning
    from chatpipe.commands.common import build_settings, check_kafka
    from inference.engine.model_store import locate_model
    from inference.engine.settings import EngineSettings
    from streams.app import StreamsApp, run_worker
    from streams.services import StreamsServices
    from transport.logs import configure_logging

    settings = build_settings(StreamsSettings, state_dir=state_dir, archive_dir=archive_dir,
                              tokenizer_path=tokenizer, log_level=log_level, metrics_port=metrics_port)
    memory = build_settings(MemorySettings, path=memory_path, url=qdrant_url)
    folder = settings.tokenizer_path or locate_model(build_settings(EngineSettings)).folder
    configure_logging("streams", settings.log_level)  # CHATPIPE_LOG_FORMAT: text or JSON lines
    if settings.torch_threads is not None:
        import torch

        torch.set_num_threads(settings.torch_threads)
    # Before the embedding model loads and the erasure registry is read: a refused password or an
    # untrusted certificate ends the start in one line (code 78), not in a 75 and a restart loop.
    check_kafka(kafka, "streams")
    services = StreamsServices.open(memory, folder)
    run_worker(StreamsApp(kafka, settings, services, cache=build_settings(CacheSettings, url=cache_url)))


def register(app: typer.Typer) -> None:
    app.command()(streams)
