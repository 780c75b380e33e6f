"""Batches of Faust events that are acked only when the agent says so.

Faust's ``take_events`` acks every event of a batch in a ``finally``, and ``events()`` each
event, even when the agent body raised; Faust's supervisor then restarts the agent on the next
batch, and the failed batch's offsets get committed. ``noack_take`` buffers the same way but
never acks: the agent acks (``Batches.ack``) once the batch's effects are durable.

Faust commits, per partition, the first run of consecutive acked offsets
(``Consumer._new_offset``), and does **not** hold that run back for an unacked event at exactly
the committed position (it only checks ``min(acked) - committed > 1``; with nothing committed
yet it does not check at all; tests/streams/test_failure_policy.py pins this). So an unacked event only
stays uncommitted if nothing after it on its partition is acked. The agents keep that true:
one agent per source topic, concurrency 1, batches handled one after another and acked in
arrival (= offset) order, and after a batch fails nothing else is acked: the process exits
(``streams/faults.py``).

Faust may also deliver an event a second time within one process: at start-up its recovery
resumes the fetcher while restoring the table and then seeks the stream partitions back to the
committed offsets, so events fetched in between come again (seen in tests/streams/
test_no_ack_on_failure.py: the same prompts served twice, 0.1 s apart). ``Batches`` remembers,
per partition, the highest offset this process handled and acked, and acks such a repeat
without handing it to the agent again. Its effects were durable before that ack, so skipping
it is exact; a new process starts with nothing remembered and handles what it is given.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Sequence

log = logging.getLogger(__name__)


class Batches:
    """An agent's batches: up to ``max_events`` events or what came within ``within_s``, none acked
    until ``ack``; events this process already handled are acked and left out."""

    def __init__(self, stream: Any, max_events: int, within_s: float) -> None:
        self.stream = stream
        self.max_events = max_events
        self.within_s = within_s
        self._handled: dict[Any, int] = {}  # TP -> highest offset handled and acked by this process
        self.repeats = 0

    async def __aiter__(self) -> AsyncIterator[Sequence[Any]]:
        async for events in self.stream.noack_take(self.max_events, self.within_s):
            fresh = [e for e in events if e.message.offset > self._handled.get(e.message.tp, -1)]
            if len(fresh) < len(events):
                repeats = [e for e in events if e not in fresh]
                for event in repeats:  # at or below acked offsets: acking keeps the acked offsets a prefix
                    await self.stream.ack(event)
                self.repeats += len(repeats)
                log.info("%d event(s) delivered again that this process had handled already; not handled again",
                         len(repeats))
            if fresh:
                yield fresh

    async def ack(self, events: Sequence[Any]) -> None:
        """Ack ``events`` in order once their effects are durable: their offsets become committable."""
        for event in events:
            await self.stream.ack(event)
            tp, offset = event.message.tp, event.message.offset
            self._handled[tp] = max(offset, self._handled.get(tp, -1))
