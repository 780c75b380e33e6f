"""``Batches`` withholds events handed out past offsets Faust never delivered (streams/faust_runtime/acks.py), until the
missing ones come, and ends the process when they do not: acking past a gap would let Faust commit over
the missing event. Faust's stream is replaced by a double that hands out the given events: the drop it
guards against (Faust's recovery resuming before its seek, faust-streaming#216) happened about once in
thirty streams restarts on the whole stack and cannot be produced on demand."""

from __future__ import annotations

import pytest

import streams.faust_runtime.acks as acks
from streams.faust_runtime.acks import Batches, DeliveryGapError
from tests.streams.test_failure_policy import FakeEvent, FakeStream

TP = ("p.chat.prompts", 0)


class FakeConsumer:
    """Faust's consumer as ``Batches`` reads it: what Faust knows is committed (``committed``), what the
    broker says the group committed (``group_committed``, through Faust's consumer thread; an exception
    instance: the broker does not answer), and the log's first offset."""

    def __init__(self, committed: int | None, earliest: int = 0, group_committed: int | None | Exception = None
                 ) -> None:
        self._committed_offset = {TP: committed}
        self.earliest = earliest
        self.group_committed = group_committed
        self._thread = self  # faust's consumer thread: _ensure_consumer() and call_thread()

    async def earliest_offsets(self, *tps):
        return {tp: self.earliest for tp in tps}

    def _ensure_consumer(self):
        return self

    async def call_thread(self, fun, *args):
        return await fun(*args)

    async def committed(self, tp):
        if isinstance(self.group_committed, Exception):
            raise self.group_committed
        return self.group_committed


def stream_with(consumer, *batches):
    from types import SimpleNamespace

    stream = FakeStream(*batches)
    stream.app = SimpleNamespace(consumer=consumer)
    return stream


def events(*offsets):
    return [FakeEvent(0, o) for o in offsets]


async def handed_out(batches: Batches) -> list[int]:
    handed = []
    async for got in batches:
        handed += [e.message.offset for e in got]
        await batches.ack(got)
    return handed


async def test_events_past_a_gap_wait_for_the_missing_ones_and_are_acked_only_after_them():
    """Faust's recovery: 3 came before 2, then its seek back delivered 2 and 3 again."""
    stream = FakeStream(events(0, 1), events(3), events(2, 3, 4))
    assert await handed_out(Batches(stream, 32, 0.05)) == [0, 1, 2, 3, 4]
    offsets = [o for _, o in stream.acked]
    assert offsets == [0, 1, 2, 3, 4, 3]  # the withheld copy of 3 is acked after 3 was handled, not before 2


async def test_a_first_event_past_the_committed_position_is_held_until_the_seek_delivers_the_rest():
    stream = stream_with(FakeConsumer(committed=9), events(10, 11), events(9, 10, 11, 12))
    assert await handed_out(Batches(stream, 32, 0.05)) == [9, 10, 11, 12]
    assert sorted(o for _, o in stream.acked) == [9, 10, 10, 11, 11, 12]


async def test_missing_offsets_that_never_come_end_the_process_with_nothing_past_them_acked(monkeypatch):
    """The case seen: offset 9 of chat.turns never delivered; 10.. handed out and committed over it."""
    monkeypatch.setattr(acks, "GAP_GRACE_S", 0.0)
    stream = stream_with(FakeConsumer(committed=9), events(10), events(11))
    with pytest.raises(DeliveryGapError, match=r"offsets from 9 never delivered"):
        await handed_out(Batches(stream, 32, 0.05))
    assert stream.acked == []


async def test_offsets_removed_by_retention_and_a_partition_moved_on_elsewhere_are_no_gap():
    retention = stream_with(FakeConsumer(committed=9, earliest=50), events(50, 51))
    assert await handed_out(Batches(retention, 32, 0.05)) == [50, 51]

    consumer = FakeConsumer(committed=0)
    moved = stream_with(consumer, events(0, 1), events(20))
    batches = Batches(moved, 32, 0.05)
    iterator = batches.__aiter__()
    await batches.ack(await iterator.__anext__())
    consumer._committed_offset[TP] = 20  # revoked, another member committed up to 20, assigned back
    assert [e.message.offset for e in await iterator.__anext__()] == [20]


async def test_events_delivered_again_are_no_gap():
    stream = stream_with(FakeConsumer(committed=3), events(3, 4), events(3, 4, 5))
    assert await handed_out(Batches(stream, 32, 0.05)) == [3, 4, 5]


async def test_with_nothing_committed_a_first_event_past_the_logs_start_waits_for_the_start():
    """The case seen on the scale-out stack: a fresh group, offsets 0 and 1 fetched during a rebalance and
    dropped, 2.. handed out first; with nothing committed Faust's commit would go over 0 and 1."""
    stream = stream_with(FakeConsumer(committed=None), events(2, 3), events(0, 1, 2, 3, 4))
    assert await handed_out(Batches(stream, 32, 0.05)) == [0, 1, 2, 3, 4]
    assert sorted(o for _, o in stream.acked) == [0, 1, 2, 2, 3, 3, 4]


async def test_with_nothing_committed_a_start_that_never_comes_ends_the_process(monkeypatch):
    monkeypatch.setattr(acks, "GAP_GRACE_S", 0.0)
    stream = stream_with(FakeConsumer(committed=None), events(2), events(3))
    with pytest.raises(DeliveryGapError, match=r"offsets from 0 never delivered"):
        await handed_out(Batches(stream, 32, 0.05))
    assert stream.acked == []


async def test_with_nothing_committed_reading_from_the_logs_start_is_no_gap():
    stream = stream_with(FakeConsumer(committed=None, earliest=50), events(50, 51), events(52))
    assert await handed_out(Batches(stream, 32, 0.05)) == [50, 51, 52]


async def test_before_faust_knows_the_committed_offset_the_brokers_is_expected():
    """A restarted worker is handed offset 7 before Faust's seek back tells it the group committed 7: no
    gap (taking the log's start for it held 7 for offsets 0..6 that never come, a restart loop)."""
    stream = stream_with(FakeConsumer(committed=None, group_committed=7), events(7, 8), events(9))
    assert await handed_out(Batches(stream, 32, 0.05)) == [7, 8, 9]

    behind = stream_with(FakeConsumer(committed=None, group_committed=5), events(7, 8), events(5, 6, 7, 8))
    assert await handed_out(Batches(behind, 32, 0.05)) == [5, 6, 7, 8]


async def test_a_broker_that_does_not_say_where_the_group_stands_means_no_check():
    stream = stream_with(FakeConsumer(committed=None, group_committed=TimeoutError("no answer")), events(7, 8))
    assert await handed_out(Batches(stream, 32, 0.05)) == [7, 8]
