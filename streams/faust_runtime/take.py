"""Adaptive batches of a Faust stream: a batch stays open only while events keep arriving.

Faust's ``noack_take(n, within)`` hands out a batch when ``n`` events are buffered or when its
timer, ``within`` seconds, fires; the timer runs whether or not anything is buffered, so a lone
prompt waits a random part of the window (0-50 ms with the intake's 0.05 s), which was the largest
single cost of a lone prompt's time to its first token (docs/streams.md "Where a lone prompt's
time goes"). ``take_while_arriving`` buffers the same way (a processor on the stream, the stream
drained in the background, nothing acked: the agent acks, ``acks.Batches``) but closes a batch

- at ``max_events`` events (as Faust does; the buffer never holds more),
- as soon as no further event arrived within ``idle_s`` of the last one: with 0, as soon as the
  event loop has turned once without a new event, i.e. nothing more was waiting in the stream's
  channel right now; a few milliseconds also gather the records of one fetch, which Faust's
  consumer hands to the channel one per loop turn, and a client's burst,
- or ``within_s`` after its first event at the latest, even while events keep trickling in.

Under a backlog the channel always holds the next events, so batches fill to ``max_events`` as
before (batching is kept under load); an idle tier hands a lone event out at once. While a batch
is out (handed to the agent, not yet taken back by the next ``__anext__``), the next one is
buffered already, up to ``max_events``; the stream's drainer then waits for room, as Faust's does.

The buffering is Faust's own mechanism (``add_processor`` + ``_enable_passive``, the two calls
``noack_take`` makes; faust-streaming 0.15.3), only the closing rule differs.

Upstream: faust-streaming 0.15.3 ``Stream.noack_take`` (``faust/streams/stream.py``), whose timer
closes a batch every ``within`` seconds whatever is buffered. Tests: tests/streams/test_adaptive_batching.py
``test_a_lone_event_is_handed_out_at_once_not_after_the_window``,
``test_a_batch_stays_open_while_events_keep_coming_but_not_past_the_window``.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator


async def take_while_arriving(stream: Any, max_events: int, within_s: float,
                              idle_s: float) -> AsyncIterator[list[Any]]:
    """Lists of ``stream``'s events (never acked here), closed as the module docstring says."""
    buffer: list[Any] = []
    arrived = asyncio.Event()  # set by each event put into the buffer
    room = asyncio.Event()  # cleared while the buffer holds max_events
    room.set()
    loop = asyncio.get_running_loop()
    first_at = 0.0  # loop time the buffer's first event came

    async def add_to_buffer(value: Any) -> Any:
        nonlocal first_at
        try:
            while not room.is_set():
                await room.wait()
            event = stream.current_event
            if event is None:
                raise RuntimeError("the take buffer found no current event")
            if not buffer:
                first_at = loop.time()
            buffer.append(event)
            arrived.set()
            if len(buffer) >= max_events:
                room.clear()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # as Faust's noack_take: the stream crashes, the agent sees it
            stream.log.exception("Error adding to take buffer: %r", exc)
            await stream.crash(exc)
        return value

    acks_were = stream.enable_acks
    stream.enable_acks = False  # the agent acks, once the batch's effects are durable
    stream.add_processor(add_to_buffer)
    stream._enable_passive(aiter(stream.channel))
    try:
        while not stream.should_stop:
            if not buffer:
                arrived.clear()
                await stream.wait_for_stopped(arrived)
                continue
            closes_at = first_at + within_s
            while len(buffer) < max_events and loop.time() < closes_at:
                size = len(buffer)
                await asyncio.sleep(0)  # the drainer's turn: it moves one waiting event per turn
                if len(buffer) > size:
                    continue
                if idle_s <= 0:
                    break  # nothing was waiting: close
                arrived.clear()
                await stream.wait_for_stopped(arrived, timeout=min(idle_s, closes_at - loop.time()))
                if len(buffer) == size:
                    break  # nothing came within idle_s: close
            if stream.should_stop:
                break
            batch = list(buffer)
            buffer.clear()
            room.set()
            yield batch
    finally:
        stream.enable_acks = acks_were
        stream._processors.remove(add_to_buffer)
