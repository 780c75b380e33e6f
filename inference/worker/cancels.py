"""Cancels from ``chat.cancels``: every worker reads every partition (from the end, no group), since
only the worker running a generation can stop it. Runs in its own thread; each Cancel is handed
to the event loop. A Cancel for a request not seen yet is remembered (bounded), so a request
that arrives after its own Cancel is answered CANCELLED without running. If the thread dies,
``on_failure`` tells the worker, which stops: a worker that no longer hears Cancels would run
cancelled generations to the end. A record that is not a Cancel is handed to ``on_undecodable``
(the worker dead-letters it): every worker sees it, and each sends the same letter (one event id,
``transport.dead_letters.dead_letter_id``), so it is one fact on ``chat.dlq``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from typing import Callable

from schemas.codec import AvroCodec
from schemas.errors import DecodeError
from schemas.records import Cancel
from transport.message import ConsumedMessage
from transport.settings import KafkaSettings
from transport.tail_consumer import TailConsumer

log = logging.getLogger(__name__)

CANCELS = "chat.cancels"


class RecentCancels:
    """request_id -> reason of the last ``capacity`` cancels (oldest forgotten first)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, str] = OrderedDict()

    def add(self, request_id: str, reason: str) -> None:
        self._ids[request_id] = reason
        self._ids.move_to_end(request_id)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def pop(self, request_id: str) -> str | None:
        return self._ids.pop(request_id, None)


class CancelListener:
    def __init__(self, kafka: KafkaSettings, codec: AvroCodec, poll_timeout_s: float = 0.1) -> None:
        self.kafka = kafka
        self.codec = codec
        self.poll_timeout_s = poll_timeout_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()

    def start(self, loop: asyncio.AbstractEventLoop, on_cancel: Callable[[Cancel], None],
              on_failure: Callable[[BaseException], None],
              on_undecodable: Callable[[ConsumedMessage, DecodeError], None] | None = None) -> None:
        self._loop, self._on_cancel, self._on_failure = loop, on_cancel, on_failure
        self._on_undecodable = on_undecodable
        self._consumer = TailConsumer(self.kafka, topics=[self.kafka.topic(CANCELS)],
                                      extra_config={"fetch.wait.max.ms": 10})
        self._thread = threading.Thread(target=self._run, name="chatpipe-cancels", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                messages = self._consumer.poll_messages(100, self.poll_timeout_s)
                self.ready.set()  # the first poll resolved the end offsets
                for message in messages:
                    try:
                        cancel = self.codec.decode(message.value or b"", Cancel, topic=message.topic,
                                                   partition=message.partition, offset=message.offset)
                    except DecodeError as exc:
                        log.warning("undecodable record on %s: %s", message.topic, exc)
                        if self._on_undecodable is not None:
                            self._loop.call_soon_threadsafe(self._on_undecodable, message, exc)
                        continue
                    self._loop.call_soon_threadsafe(self._on_cancel, cancel)
        except BaseException as exc:  # noqa: BLE001 - the worker must hear of it and stop
            log.exception("cancel listener failed")
            try:
                self._loop.call_soon_threadsafe(self._on_failure, exc)
            except RuntimeError:  # the loop is closed: the worker has gone already
                pass
        finally:
            self._consumer.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
