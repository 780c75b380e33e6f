"""How long Faust's consumer lets the broker hold a fetch: ``StreamsSettings.fetch_max_wait_ms``, not 1500 ms.

faust-streaming 0.15.3 builds its aiokafka consumer with ``fetch_max_wait_ms=1500``, fixed
(``AIOKafkaConsumerThread._create_worker_consumer``). A fetch held by the broker returns as soon as a
record arrives on a partition it asked for, but aiokafka leaves out of the next fetch every partition
whose records are still buffered in the process (not yet handed to an agent), and keeps one fetch in
flight per broker: a prompt that lands on a partition the fetch in flight did not ask for waits for that
fetch to run out. Measured through the whole stack (2026-12-06, the 2-core VM, lone requests one after
another, spans of the gateway and streams): 2 of 7 prompts were taken by intake **1.57-1.61 s** after
the gateway produced them (the other five 50-110 ms); with 100 ms, the longest of 11 was 250 ms, on a
machine building Go beside it. Every prompt pays it, cached or not; a response-cache hit, which skips
the worker, shows it most.

The price of a short wait is empty fetches from an idle consumer: ``bench/kafka_hop.py`` measured four
idle librdkafka consumers at 100 ms cost the broker 4.4% of a core (44.7% at 5 ms, docs/streams.md);
this is one consumer.

``install`` wraps ``_create_worker_consumer`` (a monkeypatch of a private method, once per process, from
``streams/app.py``) to set the consumer's ``_fetch_max_wait_ms`` before ``start()`` builds its fetcher
from it (aiokafka ``AIOKafkaConsumer.start``). Test: tests/streams/test_faust_offsets.py
``test_fausts_consumer_fetches_with_the_configured_wait``.
"""

from __future__ import annotations

from typing import Any

_installed: dict[str, int] = {}


def install(fetch_max_wait_ms: int) -> None:
    """Faust's consumers built after this fetch with ``fetch_max_wait_ms`` (the last value given wins)."""
    from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread

    _installed["ms"] = fetch_max_wait_ms
    if getattr(AIOKafkaConsumerThread._create_worker_consumer, "_chatpipe_fetch_wait", False):
        return
    original = AIOKafkaConsumerThread._create_worker_consumer

    def create_worker_consumer(self: Any, transport: Any) -> Any:
        consumer = original(self, transport)
        consumer._fetch_max_wait_ms = _installed["ms"]  # read by AIOKafkaConsumer.start() for its Fetcher
        return consumer

    create_worker_consumer._chatpipe_fetch_wait = True  # type: ignore[attr-defined]
    AIOKafkaConsumerThread._create_worker_consumer = create_worker_consumer
