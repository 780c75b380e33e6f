"""RecordedOffsets (streams/recorded.py): what intake waits on before a follow-up's context.

Pure asyncio: the committed positions and end offsets are plain functions here; the real ones
(Faust's consumer, the broker) are exercised by tests/streams/test_pipeline.py's follow-up test.
"""

from __future__ import annotations

import asyncio

from streams.recorded import RecordedOffsets


def _offsets(ends: dict[int, int], committed: dict[int, int] | None = None) -> RecordedOffsets:
    committed = committed or {}

    async def end_offsets(partitions):
        return {p: ends[p] for p in partitions}

    return RecordedOffsets(committed.get, end_offsets)


def test_recorded_through_is_the_later_of_what_this_process_applied_and_the_committed_position():
    offsets = _offsets({}, committed={0: 7})
    assert offsets.through(0) == 7 and offsets.through(1) == 0
    offsets.applied(0, 3)  # below the committed position: recorded by an earlier owner
    assert offsets.through(0) == 7
    offsets.applied(0, 9)
    assert offsets.through(0) == 10
    offsets.applied(1, 0)
    assert offsets.through(1) == 1


def test_wait_returns_once_record_reaches_the_end_and_at_once_when_it_is_there():
    async def scenario():
        offsets = _offsets({2: 5, 3: 1}, committed={3: 1})
        assert await offsets.wait_for_end([3], timeout_s=5) == {}  # nothing unrecorded: no wait

        async def record_later():
            for offset in range(5):
                await asyncio.sleep(0.01)
                offsets.applied(2, offset)

        loop = asyncio.get_running_loop()
        started = loop.time()
        recording = asyncio.create_task(record_later())
        short = await offsets.wait_for_end([2, 3], timeout_s=5)
        waited = loop.time() - started
        await recording
        return short, waited

    short, waited = asyncio.run(scenario())
    assert short == {}
    assert 0.04 <= waited < 1.0, waited


def test_wait_gives_up_after_its_timeout_and_names_what_is_missing():
    async def scenario():
        offsets = _offsets({4: 10})
        offsets.applied(4, 5)  # 0..5 recorded, 6..9 not
        return await offsets.wait_for_end([4], timeout_s=0.05)

    assert asyncio.run(scenario()) == {4: 4}


def test_a_partition_this_worker_does_not_read_is_not_waited_for():
    asked = []

    async def end_offsets(partitions):
        asked.append(list(partitions))
        return {p: 10 for p in partitions}

    offsets = RecordedOffsets(lambda p: None, end_offsets, owned=lambda p: p != 5)
    assert asyncio.run(offsets.wait_for_end([5], timeout_s=5)) == {}
    assert asked == []  # not even asked: another worker records it
    assert asyncio.run(offsets.wait_for_end([1, 5], timeout_s=0.01)) == {1: 10}
    assert asked == [[1]]
