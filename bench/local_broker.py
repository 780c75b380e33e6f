"""The broker a benchmark runs against: the one given, or the project's own local Kafka started on
free ports in a temporary folder and stopped afterwards."""

from __future__ import annotations

import gc
import tempfile
from contextlib import contextmanager
from typing import Iterator

from chatpipe.testing.ports import free_port  # bench/kafka_hop.py imports it from here too


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
