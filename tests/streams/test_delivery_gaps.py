"""``Batches`` refuses an event handed out past one Faust never delivered (streams/acks.py): acking it
would let Faust commit over the missing one. Faust's stream is replaced by a double that hands out the
given events: the drop it guards against (Faust's recovery resuming before its seek, faust-streaming#216)
happened about once in thirty streams restarts on the whole stack and cannot be produced on demand."""

from __future__ import annotations

import pytest

from streams.acks import Batches, DeliveryGapError
from tests.streams.test_failure_policy import FakeEvent, FakeStream

TP = ("p.chat.prompts", 0)


class FakeConsumer:
    def __init__(self, committed: int | None, earliest: int = 0) -> None:
        self._committed_offset = {TP: committed}
        self.earliest = earliest

    async def earliest_offsets(self, *tps):
        return {tp: self.earliest for tp in tps}


def stream_with(consumer, *batches):
    from types import SimpleNamespace

    stream = FakeStream(*batches)
    stream.app = SimpleNamespace(consumer=consumer)
    return stream


async def handed_out(batches: Batches) -> list[int]:
    handed = []
    async for events in batches:
        handed += [e.message.offset for e in events]
        await batches.ack(events)
    return handed


async def test_a_gap_within_the_process_stops_before_anything_past_it_is_acked():
    stream = FakeStream([FakeEvent(0, 0), FakeEvent(0, 1)], [FakeEvent(0, 3)])
    with pytest.raises(DeliveryGapError, match=r"offset 3 handed out before 2"):
        await handed_out(Batches(stream, 32, 0.05))
    assert stream.acked == [(0, 0), (0, 1)]


async def test_a_first_event_past_the_committed_position_is_a_gap():
    """The case seen: after a restart the first turn handed out was one past the committed position."""
    stream = stream_with(FakeConsumer(committed=9), [FakeEvent(0, 10), FakeEvent(0, 11)])
    with pytest.raises(DeliveryGapError, match=r"offsets 9..9 never delivered"):
        await handed_out(Batches(stream, 32, 0.05))
    assert stream.acked == []


async def test_offsets_removed_by_retention_and_a_partition_moved_on_elsewhere_are_no_gap():
    retention = stream_with(FakeConsumer(committed=9, earliest=50), [FakeEvent(0, 50), FakeEvent(0, 51)])
    assert await handed_out(Batches(retention, 32, 0.05)) == [50, 51]

    consumer = FakeConsumer(committed=0)
    moved = stream_with(consumer, [FakeEvent(0, 0), FakeEvent(0, 1)], [FakeEvent(0, 20)])
    batches = Batches(moved, 32, 0.05)
    iterator = batches.__aiter__()
    await batches.ack(await iterator.__anext__())
    consumer._committed_offset[TP] = 20  # revoked, another member committed up to 20, assigned back
    assert [e.message.offset for e in await iterator.__anext__()] == [20]


async def test_events_delivered_again_are_no_gap():
    stream = stream_with(FakeConsumer(committed=3), [FakeEvent(0, 3), FakeEvent(0, 4)], [FakeEvent(0, 3),
                                                                                          FakeEvent(0, 4),
                                                                                          FakeEvent(0, 5)])
    assert await handed_out(Batches(stream, 32, 0.05)) == [3, 4, 5]
