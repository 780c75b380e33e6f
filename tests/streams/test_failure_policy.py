"""The streams tier's failure policy in small pieces, no services: what is retried and for how long,
how records of a batch become durable before it is acked, how reply addresses are checked, and the
Faust commit rule the agents' acking order relies on.

The same policy end to end, with the real broker, Qdrant server and worker process, is in
``test_no_ack_on_failure.py``.
"""

from __future__ import annotations

import asyncio
import errno

import pytest

from streams.errors import InfrastructureUnavailableError
from streams.faults import EXIT_BUG, EXIT_INFRASTRUCTURE, Retrier, exit_code_for
from streams.memory import MemoryUnavailableError
from streams.faust_runtime.outbox import Outbox
from transport.errors import TransportError
from transport.reply_address import ReplyAddresses


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def retrier(t: FakeTime, budget_s: float = 10.0) -> Retrier:
    return Retrier(budget_s, 0.5, 4.0, sleep=t.sleep, clock=t.clock)


# --- Retrier ------------------------------------------------------------------------------------


async def test_an_outage_shorter_than_the_budget_is_ridden_out_with_backoff():
    """Qdrant away for a few seconds must cost a wait, not a batch."""
    t, calls = FakeTime(), []

    async def recall():
        calls.append(t.now)
        if len(calls) < 5:
            raise MemoryUnavailableError("connection refused")
        return "hits"

    r = retrier(t)
    assert await r.call("memory recall", recall) == "hits"
    assert t.slept == [0.5, 1.0, 2.0, 4.0] and r.retries == 4


async def test_past_the_budget_the_call_gives_up_with_a_named_error_and_the_exit_code_for_a_restart():
    """An outage longer than the budget must end in InfrastructureUnavailableError (the process then exits
    75 without acking), after about the budget, not after one try and not never."""
    t = FakeTime()

    async def write():
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(InfrastructureUnavailableError, match="archive write: still failing after 10 s") as info:
        await retrier(t).call("archive write", write)
    assert t.now == pytest.approx(10.0) and exit_code_for(info.value) == EXIT_INFRASTRUCTURE


async def test_a_bug_is_not_retried():
    """Retrying a bug cannot help; it must reach the agent's wrapper at once (exit 70, batch unacked)."""
    t, calls = FakeTime(), []

    async def broken():
        calls.append(1)
        raise TypeError("unexpected None")

    with pytest.raises(TypeError) as info:
        await retrier(t).call("memory recall", broken)
    assert calls == [1] and t.slept == [] and exit_code_for(info.value) == EXIT_BUG


# --- Outbox -------------------------------------------------------------------------------------


class FlakyTopic:
    """Stands in for a Faust topic: ``send`` hands back a delivery future, as aiokafka does; the first
    delivery of each value in ``fail_once`` fails as when the broker drops a batch."""

    def __init__(self, fail_once: set[bytes]) -> None:
        self.fail_once = set(fail_once)
        self.sent: list[bytes] = []
        self.delivered: list[bytes] = []

    def get_topic_name(self) -> str:
        return "p.chat.turns"

    async def send(self, *, key, value, headers):
        self.sent.append(value)
        future = asyncio.get_running_loop().create_future()
        if value in self.fail_once:
            self.fail_once.discard(value)
            future.set_exception(TransportError("broker went away"))
        else:
            self.delivered.append(value)
            future.set_result(None)
        return future


async def test_a_record_whose_delivery_failed_is_sent_again_before_the_batch_counts_as_durable():
    """Guards 'an audit send failure loses a Deletion': a failed delivery must be retried, and deliver()
    must not return (so the batch is not acked) until every record is on the broker."""
    topic, t = FlakyTopic({b"audit"}), FakeTime()
    outbox = Outbox(retrier(t))
    for value in (b"turn-1", b"audit", b"turn-2"):
        await outbox.send(topic, key=b"k", value=value)
    await outbox.deliver()
    assert sorted(topic.delivered) == [b"audit", b"turn-1", b"turn-2"]
    assert topic.sent.count(b"audit") == 2 and topic.sent.count(b"turn-1") == 1, "only the failed one again"


async def test_a_broker_away_past_the_budget_leaves_the_batch_undelivered():
    topic, t = FlakyTopic(set()), FakeTime()

    async def never(**record):
        raise TransportError("no broker")

    topic.send = never
    with pytest.raises(InfrastructureUnavailableError):
        await Outbox(retrier(t)).send(topic, key=b"k", value=b"v")


# --- ReplyAddresses -----------------------------------------------------------------------------


class Topics:
    def __init__(self, **topics: int) -> None:
        self.topics = dict(topics)
        self.listed = 0

    def __call__(self) -> dict[str, int]:
        self.listed += 1
        return dict(self.topics)


async def test_reply_addresses_are_checked_against_the_broker_with_a_short_cache():
    """An unknown topic or a partition outside the topic is unanswerable; a known address costs no lookup;
    a topic created after the last look but before its request is found (the gateway creates its reply
    topic, then produces), while requests older than the last look cost no lookup."""
    t, topics = FakeTime(), Topics(**{"p.chat.replies": 6})
    t.now = 1_000.0
    replies = ReplyAddresses(topics, fresh_s=30, clock=t.clock)
    assert await replies.problem("p.chat.replies", 5, sent_at_s=999.0) is None
    assert await replies.problem("p.chat.replies", None) is None and topics.listed == 1
    assert "outside 'p.chat.replies', which has 6 partition(s)" in await replies.problem(
        "p.chat.replies", 6, sent_at_s=990.0)
    assert "not a topic" in await replies.problem("gone", 0, sent_at_s=990.0)
    assert await replies.problem(None, 3) is None, "no reply address: nothing to check"
    assert "negative" in await replies.problem("p.chat.replies", -1)
    assert "empty" in await replies.problem(" ", None)
    assert topics.listed == 1, "requests produced before the last look cost no lookup"
    t.now += 0.2
    topics.topics["p.replies.gw2"] = 1  # a gateway starts, creates its topic and sends a prompt at once
    assert await replies.problem("p.replies.gw2", 0, sent_at_s=t.now) is None and topics.listed == 2
    del topics.topics["p.replies.gw2"]
    assert "not a topic" in await replies.problem("p.replies.gw2", 0, fresh=True)
    assert topics.listed == 3


async def test_a_broker_that_cannot_list_topics_is_an_infrastructure_fault():
    def down() -> dict[str, int]:
        raise TransportError("cannot reach Kafka")

    with pytest.raises(TransportError):
        await ReplyAddresses(down, fresh_s=30).problem("p.chat.replies", 0)


# --- what Faust commits -------------------------------------------------------------------------


def _faust_new_offset(committed: int | None, acked: list[int]) -> int | None:
    """What faust's Consumer would commit for one partition, from its own bookkeeping method."""
    from collections import defaultdict
    from types import SimpleNamespace

    from faust.transport.consumer import Consumer
    from faust.types import TP
    from intervaltree import IntervalTree

    tp = TP("p.chat.prompts", 0)
    state = SimpleNamespace(_acked=defaultdict(list, {tp: list(acked)}), _gap=defaultdict(IntervalTree),
                            _committed_offset=defaultdict(lambda: None, {tp: committed}),
                            _acked_index=defaultdict(set, {tp: set(acked)}))
    return Consumer._new_offset(state, tp)


def test_faust_commits_past_an_unacked_event_at_the_committed_position():
    """Pins the Faust rule streams/faust_runtime/acks.py relies on: an unacked event holds the commit back only when
    nothing after it on its partition is acked. Acked 10..11 with 12 unacked commits 12 (12 is read again);
    but with 10 unacked and 11..12 acked Faust commits 13, and with nothing committed yet it never checks.
    So the agents ack in offset order and never after a failed batch (they exit instead)."""
    assert _faust_new_offset(10, [10, 11]) == 12
    assert _faust_new_offset(10, [12, 13]) is None  # a gap of two holds the commit back ...
    assert _faust_new_offset(10, [11, 12]) == 13  # ... a gap of one (the head itself) does not
    assert _faust_new_offset(None, [3, 4]) == 5  # nor does anything before the first commit


# --- Batches ------------------------------------------------------------------------------------


class FakeEvent:
    def __init__(self, partition: int, offset: int) -> None:
        from types import SimpleNamespace

        self.message = SimpleNamespace(tp=("p.chat.prompts", partition), offset=offset)


class FakeStream:
    """Hands out the given batches through noack_take, as Faust's stream does; records the acks."""

    def __init__(self, *batches: list[FakeEvent]) -> None:
        self.batches = batches
        self.acked: list[tuple] = []

    async def noack_take(self, max_events, within_s):
        for batch in self.batches:
            yield batch

    async def ack(self, event) -> None:
        self.acked.append((event.message.tp[1], event.message.offset))


async def test_events_faust_delivers_again_in_the_same_process_are_acked_not_handled_again():
    """Guards the start-up double delivery (Faust's recovery seeks the stream partitions back after the
    fetcher has delivered from them): the same prompts were served twice, 0.1 s apart."""
    from streams.faust_runtime.acks import Batches

    first = [FakeEvent(0, 0), FakeEvent(0, 1), FakeEvent(1, 0)]
    again = [FakeEvent(0, 0), FakeEvent(0, 1), FakeEvent(0, 2), FakeEvent(1, 0), FakeEvent(1, 1)]
    stream = FakeStream(first, again)
    batches, handed = Batches(stream, 32, 0.05), []
    async for events in batches:
        handed.append([(e.message.tp[1], e.message.offset) for e in events])
        await batches.ack(events)
    assert handed == [[(0, 0), (0, 1), (1, 0)], [(0, 2), (1, 1)]]
    assert batches.repeats == 3 and sorted(stream.acked) == sorted([(0, 0), (0, 1), (1, 0)] * 2 + [(0, 2), (1, 1)])


async def test_an_unacked_batch_is_handed_out_again_when_faust_redelivers_it():
    """A batch that failed was never acked, so a redelivery of it (a rebalance) must be handled, not skipped."""
    from streams.faust_runtime.acks import Batches

    stream = FakeStream([FakeEvent(0, 0)], [FakeEvent(0, 0)])
    batches, handed = Batches(stream, 32, 0.05), 0
    async for events in batches:
        handed += len(events)  # not acked: as when the agent was cancelled mid-batch
    assert handed == 2 and stream.acked == []


async def test_both_copies_of_an_event_in_one_batch_are_handled_once_and_the_copy_acked_after_it():
    """The seek back can come before the first copy was handed out: both copies then sit in one batch
    (seen: three prompts served twice and a deletion fanned out twice after a restart)."""
    from streams.faust_runtime.acks import Batches

    stream = FakeStream([FakeEvent(0, 0), FakeEvent(0, 1), FakeEvent(0, 0), FakeEvent(0, 1), FakeEvent(0, 2)],
                        [FakeEvent(0, 2), FakeEvent(0, 3), FakeEvent(0, 3)])
    batches, handed, acked_when_handed = Batches(stream, 32, 0.05), [], []
    async for events in batches:
        handed.append([e.message.offset for e in events])
        acked_when_handed.append(sorted(o for _, o in stream.acked))
        await batches.ack(events)
    assert handed == [[0, 1, 2], [3]]
    # no copy acked before its first copy's batch is (2's copy in the second batch: a plain repeat)
    assert acked_when_handed == [[], [0, 0, 1, 1, 2, 2]]
    assert sorted(o for _, o in stream.acked) == [0, 0, 1, 1, 2, 2, 3, 3]
