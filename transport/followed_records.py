"""The latest record of every key of a compacted topic, as a reader keeps it: followed from now (a
broadcast listener, no group) after the topic is read to its end, each record merged with what came
before it. The Batch API's ``chat.batches`` (transport/batch_book.py) and the Responses API's
``chat.api.responses`` (gateway/responses_routes.py) are kept so by every gateway.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from schemas.codec import AvroCodec, default_codec
from schemas.errors import DecodeError
from transport.broadcast import BroadcastListener
from transport.settings import IDLE_FETCH_WAIT_MS, KafkaSettings
from transport.topic_scan import read_to_end


class FollowedRecords:
    """The latest record of every key of a compacted topic, each merged with what came before it
    (``merge``), kept current from the topic (``start``: followed from now, then read to its end) or read
    once (``load``). Every gateway keeps ``chat.batches`` and ``chat.api.responses`` so."""

    def __init__(self, kafka: KafkaSettings, topic: str, record_type: type, key: Callable[[Any], str],
                 merge: Callable[[Any, Any], Any] = lambda old, new: new, codec: AvroCodec | None = None) -> None:
        self.kafka, self.topic, self.record_type, self.key, self.merge = kafka, topic, record_type, key, merge
        self.codec = codec or default_codec()
        self._lock = threading.Condition()
        self._records: dict[str, Any] = {}
        self.listener: BroadcastListener | None = None
        self.on_apply: Callable[[Any], None] = lambda record: None  # told of each record as merged

    def start(self, on_failure: Callable[[BaseException], None], timeout_s: float = 30.0) -> None:
        """Follow the topic from now, then read what it holds (blocking until read)."""
        listener = self.listener = BroadcastListener(self.kafka, self.codec)
        listener.topic, listener.record_type = self.topic, self.record_type
        listener.thread_name, listener.fetch_wait_ms = f"chatpipe-{self.topic}", IDLE_FETCH_WAIT_MS
        listener.start(None, self.apply, on_failure)
        listener.ready.wait(10.0)
        self.load(timeout_s)

    def load(self, timeout_s: float = 30.0):
        def take(message: Any) -> None:
            if message.value() is not None:
                try:
                    self.apply(self.codec.decode(message.value(), self.record_type))
                except DecodeError:
                    pass  # not ours to fix here; every writer of the topic is a gateway of this version or later

        read_to_end(self.kafka, self.kafka.topic(self.topic), take, timeout_s=timeout_s)
        return self

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()

    def apply(self, record: Any) -> Any:
        key = self.key(record)
        with self._lock:
            merged = self._records[key] = self.merge(self._records.get(key), record)
            self._lock.notify_all()
        self.on_apply(merged)
        return merged

    def record(self, key: str) -> Any:
        with self._lock:
            return self._records.get(key)

    def wait_record(self, key: str, timeout_s: float) -> Any:
        """``record``, waiting up to ``timeout_s`` for one another gateway has just written to reach this one."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while key not in self._records and (left := deadline - time.monotonic()) > 0:
                self._lock.wait(left)
            return self._records.get(key)

    def records(self) -> list[Any]:
        with self._lock:
            return list(self._records.values())
