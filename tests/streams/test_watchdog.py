"""The streams progress watchdog: records waiting on an assigned partition that reach no agent make the
process exit (streams/faust_runtime/watchdog.py says where that was seen). The decision is checked here with a chosen
broker answer and clock (a real stalled Faust fetcher cannot be produced on demand: it was seen about once
in six streams restarts); ``TopicAdmin.backlogs``, which gives that answer, against the real broker."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from streams.faust_runtime.watchdog import (ProgressWatchdog, RestoreProgress, StalledConsumerError, faust_restore,
                                           restore_stalls)
from transport.errors import TransportError

TP = ("chat.prompts", 3)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class AgentBatches:  # what the watchdog reads of streams.faust_runtime.acks.Batches
    out: bool = False
    last_event_at: dict = field(default_factory=dict)


def watchdog(answer, clock, batches):
    return ProgressWatchdog(lambda tps: answer(tps), stall_s=30, clock=clock, batches=batches)


def test_waiting_records_that_reach_no_agent_are_a_stall_after_stall_s():
    clock, agent = Clock(), AgentBatches(last_event_at={TP: 990.0})
    dog = watchdog(lambda tps: {TP: (41, 56)}, clock, [agent])
    assert dog.check([TP]) == []  # first sight of the frozen position
    clock.now += 29
    assert dog.check([TP]) == []
    clock.now += 2
    assert dog.check([TP]) == [TP]


@pytest.mark.parametrize("case", ["batch out", "event seen", "offset moved", "nothing waits", "broker away"])
def test_progress_or_an_idle_partition_is_no_stall(case):
    clock, agent = Clock(), AgentBatches()
    position = {"value": 41}

    def answer(tps):
        if case == "broker away":
            raise TransportError("list offsets: no answer")
        end = position["value"] if case == "nothing waits" else 56
        return {TP: (position["value"], end)}

    dog = watchdog(answer, clock, [agent])
    for _ in range(5):
        clock.now += 20
        if case == "batch out":
            agent.out = True  # e.g. a batch retrying an outage: bounded by its own retry budget
        elif case == "event seen":
            agent.last_event_at[TP] = clock.now - 1
        elif case == "offset moved":
            position["value"] += 1
        assert dog.check([TP]) == [], case


def test_run_raises_naming_the_partition_and_skips_while_nothing_is_assigned():
    agent = AgentBatches()
    dog = ProgressWatchdog(lambda tps: {TP: (41, 56)}, stall_s=0.05, batches=[agent])
    assigned = iter([[], [TP], [TP], [TP], [TP], [TP]])

    with pytest.raises(StalledConsumerError, match=r"chat.prompts\[3\] at 41"):
        asyncio.run(asyncio.wait_for(dog.run(lambda: next(assigned), check_every_s=0.03), 5))


CHANGELOG = ("chatpipe-streams-conversations-changelog", 4)


def test_a_restore_that_receives_nothing_for_stall_s_is_a_stall():
    # the CI run of 2026-12-06: one record to restore, none received since the restore began
    quiet = RestoreProgress(started_at=1000.0, remaining={CHANGELOG: 1}, received_at={})
    assert restore_stalls(quiet, 1029.0, stall_s=30) == {}
    assert restore_stalls(quiet, 1031.0, stall_s=30) == {
        CHANGELOG: "chatpipe-streams-conversations-changelog[4] (1 record(s) to restore, none received for 31 s)"}
    # records arriving, or nothing left, or no restore: no stall however long it takes
    arriving = RestoreProgress(1000.0, {CHANGELOG: 500}, {CHANGELOG: 1100.0})
    done = RestoreProgress(1000.0, {CHANGELOG: 0}, {})
    assert restore_stalls(arriving, 1110.0, 30) == restore_stalls(done, 1110.0, 30) == restore_stalls(None, 1110.0, 30) == {}


def test_run_raises_on_a_stalled_restore_while_nothing_is_assigned_unless_the_broker_is_away():
    clock, asked = Clock(), []

    def stalled_restore():
        return RestoreProgress(clock.now - 31, {CHANGELOG: 1}, {})

    def broker_away(tps):
        asked.append(tps)
        raise TransportError("list offsets: no answer")

    away = ProgressWatchdog(broker_away, stall_s=30, clock=clock, batches=[], restore=stalled_restore)
    with pytest.raises(asyncio.TimeoutError):  # an outage: the consumer's to ride out
        asyncio.run(asyncio.wait_for(away.run(lambda: [], check_every_s=0.01), 0.3))
    assert asked and asked[0] == [CHANGELOG]
    dog = ProgressWatchdog(lambda tps: {CHANGELOG: (0, 1)}, stall_s=30, clock=clock, batches=[], restore=stalled_restore)
    with pytest.raises(StalledConsumerError, match=r"the table restore stalled: .*changelog\[4\] \(1 record"):
        asyncio.run(asyncio.wait_for(dog.run(lambda: [], check_every_s=0.01), 5))


def test_the_restore_is_read_from_fausts_own_recovery_counters():
    """Against the installed faust-streaming (its Recovery's attribute names are what ``faust_restore`` reads):
    a real App's recovery, not started (no broker), with its counters set as its restore sets them."""
    import faust
    from faust.types import TP as FaustTP

    app = faust.App("watchdog-test", broker="kafka://127.0.0.1:9", store="memory://")
    progress = faust_restore(app)
    assert progress() is None  # no restore in progress
    recovery = app.tables.recovery
    tp = FaustTP(*CHANGELOG)
    recovery.active_highwaters[tp] = 0  # one record, offset 0
    recovery.active_offsets[tp] = -1  # nothing restored yet
    recovery._set_recovery_started()
    seen = progress()
    assert seen is not None and seen.remaining == {CHANGELOG: 1} and seen.received_at == {}
    recovery._active_events_received_at[tp] = seen.started_at + 5
    assert progress().received_at == {CHANGELOG: seen.started_at + 5}
    recovery._set_recovery_ended()
    assert progress() is None


@pytest.mark.integration
def test_backlogs_from_the_broker(kafka_settings, topic_factory):
    from confluent_kafka import Consumer, Producer, TopicPartition

    from transport.admin import TopicAdmin

    topic = topic_factory(partitions=2)
    producer = Producer(kafka_settings.client_config())
    for i in range(5):
        producer.produce(topic, value=b"x", partition=0)
    producer.flush(10)
    admin, group = TopicAdmin(kafka_settings), "watchdog-backlogs"
    assert admin.backlogs(group, [(topic, 0), (topic, 1)]) == {(topic, 0): (0, 5), (topic, 1): (0, 0)}
    consumer = Consumer({**kafka_settings.client_config(), "group.id": group})
    consumer.commit(offsets=[TopicPartition(topic, 0, 3)], asynchronous=False)
    consumer.close()
    assert admin.backlogs(group, [(topic, 0)]) == {(topic, 0): (3, 5)}


def test_an_event_loop_that_stops_turning_ends_the_process_with_its_stacks():
    """The watchdog itself runs on the loop; a loop blocked in a synchronous call is caught by a thread."""
    import subprocess
    import sys

    code = ("import time, logging; logging.basicConfig()\n"
            "from streams.faust_runtime.watchdog import LoopHeartbeat\n"
            "LoopHeartbeat(0.5).start()\n"
            "def blocked_in_a_sync_call():\n    time.sleep(30)\n"
            "blocked_in_a_sync_call()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 75, done.stderr
    assert "has not turned" in done.stderr and "blocked_in_a_sync_call" in done.stderr


class _Consumer:
    """Stands in for Faust's consumer (a real one cannot be stalled on demand, see the module's note):
    only ``commit()``, the call the stall exit makes."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour, self.commits = behaviour, 0

    async def commit(self) -> bool:
        self.commits += 1
        if self.behaviour == "hangs":
            await asyncio.sleep(60)
        if self.behaviour == "fails":
            raise RuntimeError("coordinator not available")
        return True


@pytest.mark.parametrize("behaviour, committed", [("commits", True), ("hangs", False), ("fails", False)])
def test_a_stall_exit_commits_what_was_acked_or_says_what_is_read_again(behaviour, committed, caplog):
    from types import SimpleNamespace

    from streams.faust_runtime.watchdog import commit_acked_before_exit

    app = SimpleNamespace(consumer=_Consumer(behaviour))
    with caplog.at_level("INFO", logger="streams.faust_runtime.watchdog"):
        assert asyncio.run(commit_acked_before_exit(app, timeout_s=0.2)) is committed
    assert app.consumer.commits == 1
    said = caplog.text
    assert ("committed the acknowledged offsets" in said) is committed
    assert ("read again after the restart" in said) is not committed
