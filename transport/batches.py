"""How consumers build their batches without a garbage collection per poll: ``wrap_batch`` and the
GC pause ``pause_gc`` (used by ``GroupReader.poll_messages``, the inference worker's intake).

A consumer loop allocates at least one Python object per message, and the way it does so decides
how much time CPython's cyclic garbage collector takes (see ``pause_gc``). Measured in
``bench/kafka_io.py`` (docs/benchmarks.md, "bench/kafka_io.py").
"""

from __future__ import annotations

import gc
import threading

from confluent_kafka import Message

from transport.message import ConsumedMessage


# --- building batches -------------------------------------------------------------------------

_gc_lock = threading.Lock()
_gc_pauses = 0  # how many pauses are open, over all threads
_gc_was_enabled = True  # the collector's state when the first of them opened


def pause_gc() -> None:
    """Start a stretch in which no cyclic-GC collection starts; end it with :func:`resume_gc`.

    Why: CPython starts a young-generation collection once allocations minus deallocations of
    container objects pass 700. A consumer loop holds its previous batch while it polls the next,
    so wrapping 500 messages (on top of the 500 ``Message`` objects librdkafka hands back) crosses
    that line in the middle of every poll: the previous batch, about to be dropped, is found alive
    and promoted, and every few polls a full collection walks the whole heap. ``bench/kafka_io.py``,
    when it measured the batch consumer, saw 109 young, 10 middle and about 1 full collection per 60k
    messages consumed, 60-260 ms, most of what the consumer cost over a raw loop (which crosses no
    threshold: the 500 messages it gets are balanced by the 500 it drops). With the batch built in a
    pause, the count is balanced again once the caller drops its previous batch, and the collector
    runs only when objects really pile up. Nothing is skipped: a collection that is due starts at
    the first allocation after the pause.

    Process-wide (the collector is), nestable and thread-safe; a collector already disabled when
    the first pause opens stays disabled. Not a context manager on purpose: leaving a
    generator-based one allocates, which would start the deferred collection before the caller
    drops its batch.
    """
    global _gc_pauses, _gc_was_enabled
    _gc_lock.acquire()
    try:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    finally:
        _gc_lock.release()


def resume_gc() -> None:
    """End a stretch begun by :func:`pause_gc`."""
    global _gc_pauses
    # acquire()/release(), not `with`: a lock's __exit__ takes its arguments as a new tuple, and
    # that one allocation would start the deferred collection right here.
    _gc_lock.acquire()
    try:
        _gc_pauses -= 1
        if _gc_pauses == 0 and _gc_was_enabled:
            gc.enable()
    finally:
        _gc_lock.release()


_message_error = Message.error


def wrap_batch(raw: list[Message]) -> list[ConsumedMessage] | None:
    """``raw`` as ConsumedMessages when no message in it is an error event, else None.

    The common case, checked by a loop in C; the caller handles a batch with events (partition
    EOF, broker errors) message by message. Built in a GC pause (see :func:`pause_gc`).
    """
    if any(map(_message_error, raw)):  # a KafkaError is truthy, None is not
        return None
    pause_gc()
    try:
        batch = [ConsumedMessage(msg) for msg in raw]
    finally:
        resume_gc()
    return batch
