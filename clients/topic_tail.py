"""Read one catalog topic and turn every message into a JSON-ready dict (``chatpipe tail``).

For analytics consumers and debugging: any catalog topic (the deployment's topic prefix is put
in front), from the beginning or live from the end, one partition or all. The consumer is
assigned partitions directly (no group, nothing committed), so tailing never disturbs the
groups of the pipeline and leaves no trace on the broker.

A message whose value does not decode to the topic's record type becomes an error line with the
reason and the raw bytes (``clients.record_json.error_line``): it is shown, never skipped. What
is *not* here: writing the lines (the CLI does, so it can handle a closed pipe), and any
interpretation of the records.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable, Iterator

from confluent_kafka import OFFSET_BEGINNING, KafkaException, TopicPartition

from clients.record_json import decoded_line, error_line
from schemas.codec import AvroCodec, default_codec
from schemas.errors import ChatpipeError, DecodeError
from schemas.records import RECORD_TYPES, EmbeddingResult
from schemas.topics import BY_NAME, REPLIES, TopicSpec
from transport import clients as kafka_clients
from transport.errors import TransportError
from transport.failures import ErrorBudget
from transport.group_reader import messages_of
from transport.message import ConsumedMessage
from transport.settings import KafkaSettings

#: Catalog topics that also exist per instance as ``<name>.<instance>`` (a gateway's own reply
#: topic, ``chat.replies.<gateway_id>``): same record type as the catalog entry.
PER_INSTANCE_TOPICS = (REPLIES,)
#: Topics that carry more than their catalog record type: a reply topic also carries the
#: ``EmbeddingResult`` of POST /v1/embeddings (streams/embedding_requests.py).
ALSO_CARRIED = {REPLIES: (EmbeddingResult,)}


class UnknownTopicError(ChatpipeError):
    """The name given to ``chatpipe tail`` is not a catalog topic."""


def resolve_topic(name: str) -> TopicSpec:
    """The catalog entry of ``name`` (without the deployment's prefix)."""
    if name in BY_NAME:
        return BY_NAME[name]
    for base in PER_INSTANCE_TOPICS:
        if name.startswith(base + ".") and len(name) > len(base) + 1:
            return BY_NAME[base]
    raise UnknownTopicError(
        f"{name!r} is not a catalog topic; known: {', '.join(sorted(BY_NAME))} "
        f"(and a gateway's reply topic chat.replies.<gateway_id>; give names without the topic prefix)")


class TopicTail:
    """One topic (or one partition of it) read from a fixed start, decoded line by line.

    ``from_beginning`` starts at each partition's first retained offset; otherwise at its end
    offset *as of construction*, looked up explicitly rather than left to ``OFFSET_END``
    (which librdkafka resolves lazily at the first fetch: a message produced in between would
    be skipped, so "live" would not start at a defined point).
    """

    def __init__(self, settings: KafkaSettings, name: str, *, partition: int | None = None,
                 from_beginning: bool = False, connect_timeout_s: float = 5.0,
                 codec: AvroCodec | None = None, error_budget_s: float = 60.0) -> None:
        self.spec = resolve_topic(name)
        self.errors = ErrorBudget(error_budget_s)
        self.topic = settings.topic(name)
        self.expected = (RECORD_TYPES[self.spec.value], *ALSO_CARRIED.get(self.spec.name, ()))
        self.codec = codec or default_codec()
        self._consumer = kafka_clients.consumer(settings, f"chatpipe-tail-{uuid.uuid4().hex[:12]}", {  # never joined
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            # A missing broker is reported once by us (below), not as a page of librdkafka logs.
            "log_level": 0,
            "error_cb": lambda err: None,
        })
        try:
            self.partitions = self._assign(settings, partition, from_beginning, connect_timeout_s)
        except BaseException:
            self._consumer.close()
            raise

    def _assign(self, settings: KafkaSettings, partition: int | None, from_beginning: bool,
                timeout_s: float) -> list[int]:
        try:
            metadata = self._consumer.list_topics(self.topic, timeout=timeout_s)
        except KafkaException as exc:
            raise TransportError(f"cannot reach Kafka at {settings.bootstrap_servers} within {timeout_s:g} s "
                                 f"(is it running? `chatpipe status`)") from exc
        info = metadata.topics.get(self.topic)
        if info is None or info.error is not None or not info.partitions:
            raise TransportError(f"topic {self.topic} is not on the broker at {settings.bootstrap_servers}; "
                                 f"run `chatpipe topics apply` (with the same --topic-prefix)")
        partitions = sorted(info.partitions)
        if partition is not None:
            if partition not in info.partitions:
                raise TransportError(f"topic {self.topic} has partitions 0..{len(partitions) - 1}, not {partition}")
            partitions = [partition]
        assignment = []
        for p in partitions:
            if from_beginning:
                start = OFFSET_BEGINNING
            else:
                try:
                    _, start = self._consumer.get_watermark_offsets(TopicPartition(self.topic, p), timeout=timeout_s)
                except KafkaException as exc:
                    raise TransportError(f"cannot read the end offset of {self.topic}[{p}]: {exc}") from exc
            assignment.append(TopicPartition(self.topic, p, start))
        self._consumer.assign(assignment)
        return partitions

    def line(self, message: ConsumedMessage) -> dict[str, Any]:
        """The JSON-ready line of one message: decoded, or an error line with the raw bytes."""
        value = message.value
        if value is None:  # a tombstone (compacted topics, e.g. chat.workers.status): a valid message with no record
            return decoded_line(message, None)
        try:
            record = self.codec.decode(value)
            if not isinstance(record, self.expected):
                names = " or ".join(t.__name__ for t in self.expected)
                raise DecodeError(f"expected {names}, got {type(record).__name__}")
        except DecodeError as exc:
            return error_line(message, str(exc))
        return decoded_line(message, record)

    def batches(self, *, max_records: int | None = None, idle_timeout_s: float | None = None,
                should_stop: Callable[[], bool] = lambda: False,
                poll_s: float = 0.2) -> Iterator[list[dict[str, Any]]]:
        """Lines in batches (one per poll) until ``max_records`` lines, ``idle_timeout_s`` seconds
        without a message, or ``should_stop()`` (checked every ``poll_s``: a signal handler's flag)."""
        count, last_message = 0, time.monotonic()
        while not should_stop() and (max_records is None or count < max_records):
            want = 500 if max_records is None else min(500, max_records - count)
            raw = self._consumer.consume(want, poll_s)
            # Error events through the failure policy (transport.failures): a broker reconnecting is
            # polled through for ``error_budget_s``, anything else (an authorization failure) ends the
            # tail with the reason instead of showing nothing forever.
            batch = [self.line(m) for m in messages_of(raw, self.errors, lambda msg: f"tail of {self.topic}")]
            if batch:
                self.errors.ok()
                last_message = time.monotonic()
                count += len(batch)
                yield batch
            elif idle_timeout_s is not None and time.monotonic() - last_message >= idle_timeout_s:
                return

    def close(self) -> None:
        self._consumer.close()

    def __enter__(self) -> "TopicTail":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
