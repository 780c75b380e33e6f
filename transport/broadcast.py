"""A thread reading a broadcast topic every worker sees in full (from the end, no group), handing
each decoded record to the event loop: the inference worker's cancel and deletion listeners
(``inference/worker/cancels.py``, ``deletions.py``) and the streams tier's erasure follower
(``streams/erasures.py``).

From the end: what was sent before this worker started is not its business (a generation it
never ran, a prefix cache it never filled; the streams tier read the log to its end at start). If the thread dies, ``on_failure`` tells the worker,
which stops (docs/architecture.md "Failure policy"): a worker that no longer hears the topic must
not look healthy. A record of another type goes to ``on_undecodable`` (the worker dead-letters
it; every worker sends the same letter, one event id, so it is one fact on ``chat.dlq``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Callable

from schemas.codec import AvroCodec
from schemas.errors import DecodeError
from transport.message import ConsumedMessage
from transport.settings import KafkaSettings
from transport.tail_reader import TailReader

log = logging.getLogger(__name__)


class BroadcastListener:
    #: set by each listener: the catalog topic, the record type, the thread's name, the fetch wait
    topic: str
    record_type: type
    thread_name: str
    fetch_wait_ms: int

    def __init__(self, kafka: KafkaSettings, codec: AvroCodec, poll_timeout_s: float = 0.1) -> None:
        self.kafka = kafka
        self.codec = codec
        self.poll_timeout_s = poll_timeout_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()  # set after the first poll: records from here on are seen

    def start(self, loop: asyncio.AbstractEventLoop | None, on_record: Callable[[Any], None],
              on_failure: Callable[[BaseException], None],
              on_undecodable: Callable[[ConsumedMessage, DecodeError], None] | None = None) -> None:
        """``loop`` None: the callbacks run in the listener's own thread (for a listener started before
        any event loop, whose callback is thread-safe: the streams tier's erasure registry)."""
        self._loop, self._on_record, self._on_failure = loop, on_record, on_failure
        self._on_undecodable = on_undecodable
        self._consumer = TailReader(self.kafka, topics=[self.kafka.topic(self.topic)],
                                      extra_config={"fetch.wait.max.ms": self.fetch_wait_ms})
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                messages = self._consumer.poll_messages(100, self.poll_timeout_s)
                self.ready.set()  # the first poll resolved the end offsets
                for message in messages:
                    try:
                        record = self.codec.decode(message.value or b"", self.record_type, topic=message.topic,
                                                   partition=message.partition, offset=message.offset)
                    except DecodeError as exc:
                        log.warning("undecodable record on %s: %s", message.topic, exc)
                        if self._on_undecodable is not None:
                            self._hand(self._on_undecodable, message, exc)
                        continue
                    self._hand(self._on_record, record)
        except BaseException as exc:  # the worker must hear of it and stop
            log.exception("%s listener failed", self.topic)
            try:
                self._hand(self._on_failure, exc)
            except RuntimeError:  # the loop is closed: the worker has gone already
                pass
        finally:
            self._consumer.close()

    def _hand(self, callback: Callable[..., None], *args: Any) -> None:
        if self._loop is None:
            callback(*args)
        else:
            self._loop.call_soon_threadsafe(callback, *args)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
