"""Adaptive intake batches (streams/faust_runtime/take.py): a batch closes as soon as nothing more arrives, holds what
was waiting up to its size, stays open while events keep coming (at most the window), and hands events
out unacked; ``Batches`` on top keeps its guarantees (repeats acked not handed out, events past a gap
withheld). A real Faust stream over an in-memory channel, no broker: what differs from Faust's
``noack_take`` is only when a batch closes."""

from __future__ import annotations

import asyncio

import faust
import pytest
from faust.types import TP, Message

from streams.faust_runtime.acks import Batches
from streams.faust_runtime.take import take_while_arriving

TOPIC = "p.chat.prompts"
HOUR = 3600.0


@pytest.fixture
async def channel_stream(monkeypatch):
    """(channel, stream, acked): a Faust stream of an in-memory channel; ``acked`` lists acked events' values."""
    app = faust.App("test-adaptive-take", broker="kafka://127.0.0.1:1", store="memory://", autodiscover=False)
    app.flow_control.resume()
    acked: list = []
    ack = faust.Event.ack
    monkeypatch.setattr(faust.Event, "ack", lambda event: (acked.append(event.value), ack(event))[1])
    channel = app.channel()
    stream = app.stream(channel)
    yield channel, stream, acked
    await stream.stop()


async def next_batch(taken, timeout_s: float = 30.0) -> list:
    return await asyncio.wait_for(taken.__anext__(), timeout_s)


async def test_a_lone_event_is_handed_out_at_once_not_after_the_window(channel_stream):
    channel, stream, acked = channel_stream
    taken = take_while_arriving(stream, 32, within_s=HOUR, idle_s=0.002).__aiter__()
    await channel.send(value=b"alone")
    assert [e.value for e in await next_batch(taken)] == [b"alone"]  # an hour's window did not hold it
    await channel.send(value=b"next")
    assert [e.value for e in await next_batch(taken)] == [b"next"]
    assert acked == []  # handed out, never acked: the agent acks
    await taken.aclose()
    assert stream.enable_acks is True  # restored for whatever iterates the stream next


async def test_what_is_waiting_goes_in_one_batch_up_to_its_size(channel_stream):
    channel, stream, _ = channel_stream
    for i in range(40):
        await channel.send(value=i)
    taken = take_while_arriving(stream, 32, within_s=HOUR, idle_s=0.0).__aiter__()  # 0: only what is waiting
    first, second = await next_batch(taken), await next_batch(taken)
    assert [e.value for e in first] == list(range(32)) and [e.value for e in second] == list(range(32, 40))
    await taken.aclose()


async def test_a_batch_stays_open_while_events_keep_coming_but_not_past_the_window(channel_stream):
    channel, stream, _ = channel_stream

    async def trickle(values, gap_s: float) -> None:
        for v in values:
            await channel.send(value=v)
            await asyncio.sleep(gap_s)

    # Events 10 ms apart with 1 s of idle allowed: one batch of all of them.
    taken = take_while_arriving(stream, 32, within_s=HOUR, idle_s=1.0).__aiter__()
    sender = asyncio.create_task(trickle(range(10), 0.01))
    assert [e.value for e in await next_batch(taken)] == list(range(10))
    await sender
    await taken.aclose()

    # The same trickle for 0.4 s with a 50 ms window: the first batch closes long before the last event.
    taken = take_while_arriving(stream, 64, within_s=0.05, idle_s=1.0).__aiter__()
    sender = asyncio.create_task(trickle(range(100, 140), 0.01))
    first = [e.value for e in await next_batch(taken)]
    assert first[0] == 100 and len(first) < 40
    rest: list = []
    while len(first) + len(rest) < 40:
        rest += [e.value for e in await next_batch(taken)]
    assert first + rest == list(range(100, 140))  # nothing lost or reordered across the batches
    await sender
    await taken.aclose()


def message(offset: int, generation: int) -> Message:
    """A consumed record of partition 0 at ``offset`` (value: the offset as text)."""
    return Message(TOPIC, 0, offset, timestamp=0.0, timestamp_type=0, headers=None, key=None,
                   value=b"%d" % offset, checksum=None, tp=TP(TOPIC, 0), generation_id=generation)


async def test_batches_keep_their_guarantees_on_adaptive_takes(channel_stream):
    """The cases of test_delivery_gaps.py / test_failure_policy.py through the adaptive take: offsets past
    a gap are withheld until the missing ones come, events handed out again are acked and left out."""
    _, stream, acked = channel_stream
    batches = Batches(stream, 32, within_s=HOUR, idle_s=0.002)
    taken = batches.__aiter__()

    async def deliver(*offsets: int) -> None:
        for o in offsets:
            await stream.channel.deliver(message(o, stream.app.consumer_generation_id))  # the queue the stream reads

    await deliver(0, 1)
    first = await next_batch(taken)
    assert [e.message.offset for e in first] == [0, 1] and acked == [] and batches.out
    await batches.ack(first)
    await deliver(3)  # past a gap (2 never came): withheld, neither handed out nor acked
    await deliver(2, 3, 4, 0)  # the missing 2, then 3 and 4 again, and a repeat of 0
    handed: list[int] = []
    while len(handed) < 3:
        got = await next_batch(taken)
        handed += [e.message.offset for e in got]
        assert b"3" not in acked[2:] or b"2" in acked[2:]  # nothing past the gap acked before it
        await batches.ack(got)
    assert handed == [2, 3, 4]
    assert acked.count(b"0") == 2 and batches.repeats == 1  # the repeat acked, never handed out
    assert acked.count(b"3") == 2 and acked.index(b"2") < acked.index(b"3")  # the withheld copy acked after 3
    await taken.aclose()
