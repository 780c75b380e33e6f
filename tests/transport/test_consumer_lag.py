"""``transport.lag`` against the real broker: a consumer group's and a share group's lag in records and
in seconds (from the oldest waiting record's own timestamp), a group that never committed, and a
broker that does not answer (lag not known, the monitor goes on)."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from transport.lag import GroupTopics, LagMonitor, LagReader, TopicLag
from transport.settings import KafkaSettings
from transport.share_offsets import share_group_offsets

pytestmark = pytest.mark.integration

AGE_S = 100.0  # the records are stamped this long ago (plus their index in seconds)


def _produce(kafka: KafkaSettings, topic: str, partitions: int, n: int) -> float:
    """``n`` records round-robin over the partitions, record i stamped ``AGE_S - i`` seconds ago; returns now."""
    now = time.time()
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers})
    for i in range(n):
        producer.produce(topic, value=b"r%d" % i, partition=i % partitions, timestamp=int((now - AGE_S + i) * 1000))
    assert producer.flush(10) == 0
    return now


@pytest.fixture
def reader(kafka_settings):
    r = LagReader(kafka_settings)
    yield r
    r.close()


def test_consumer_group_lag_is_end_minus_committed_and_its_age_the_record_at_committed(
        kafka_settings, topic_factory, reader):
    """Guards against lag counted from the wrong end (records after the commit, not before), an age
    taken from the newest record instead of the oldest waiting one, and a caught-up partition
    hiding behind a lagging one."""
    topic = topic_factory(partitions=2)
    now = _produce(kafka_settings, topic, 2, 10)  # p0: records 0,2,4,6,8; p1: 1,3,5,7,9
    group = f"lag-{uuid.uuid4().hex[:8]}"
    never = reader.read([GroupTopics(group, (topic,))], now_ms=int(now * 1000))
    assert never == [TopicLag(group, topic, 10, pytest.approx(AGE_S, abs=0.01))]  # from the first offset

    committer = Consumer({"bootstrap.servers": kafka_settings.bootstrap_servers, "group.id": group})
    committer.commit(offsets=[TopicPartition(topic, 0, 3), TopicPartition(topic, 1, 5)], asynchronous=False)
    committer.close()
    lag = reader.read([GroupTopics(group, (topic,))], now_ms=int(now * 1000))
    # p0 waits on offsets 3 and 4 (records 6 and 8: the oldest is record 6), p1 on nothing
    assert lag == [TopicLag(group, topic, 2, pytest.approx(AGE_S - 6, abs=0.01))]


def test_an_empty_topic_and_a_caught_up_group_are_zero_not_unknown(kafka_settings, topic_factory, reader):
    """Guards against "not known" (None) or a stale age for a group that has nothing waiting."""
    empty = topic_factory(partitions=1)
    assert reader.read([GroupTopics("nobody", (empty,))]) == [TopicLag("nobody", empty, 0, 0.0)]


def test_share_group_lag_is_the_brokers_count_of_records_not_acknowledged(kafka_settings, topic_factory, reader):
    """Guards against share groups reported as "not known" (confluent-kafka has no call for it:
    transport/share_offsets.py asks the broker itself) and acquired-but-unacknowledged records counted
    as done."""
    from transport.admin import TopicAdmin
    from transport.share_reader import ACCEPT, ShareGroupReader

    topic = topic_factory(partitions=1)
    now = _produce(kafka_settings, topic, 1, 6)
    group = f"lag-share-{uuid.uuid4().hex[:8]}"
    assert [(o.start_offset, o.lag) for o in share_group_offsets(kafka_settings, group, {topic: [0]})] in (
        [], [(-1, None)])  # no such group yet: no state on the partition
    TopicAdmin(kafka_settings).set_share_group_config(group, {"share.auto.offset.reset": "earliest"})
    before = reader.read([GroupTopics(group, (topic,), "share")], now_ms=int(now * 1000))
    assert before == [TopicLag(group, topic, 6, pytest.approx(AGE_S, abs=0.01))]  # nothing fetched: all waits

    consumer = ShareGroupReader(kafka_settings, group_id=group, topics=[topic])
    try:
        got, deadline = [], time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            got = consumer.poll_messages(1.0)
        assert [m.offset for m in got][:4] == [0, 1, 2, 3], [m.offset for m in got]
        for m in got[:4]:
            consumer.acknowledge(m, ACCEPT)  # the rest stay acquired, not acknowledged
        consumer.commit(asynchronous=False)
        deadline = time.monotonic() + 15
        while True:  # the broker's share-partition state is written asynchronously
            lag = reader.read([GroupTopics(group, (topic,), "share")], now_ms=int(now * 1000))
            if lag[0].records == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert lag == [TopicLag(group, topic, 2, pytest.approx(AGE_S - 4, abs=0.01))]  # records 4 and 5 wait
    finally:
        consumer.close()


def test_the_monitor_reports_not_known_while_the_broker_is_away_and_goes_on(kafka_settings, topic_factory):
    """Guards against a lag measurement taking its service down, or a stale figure shown as current
    while the broker does not answer."""
    away = KafkaSettings(bootstrap_servers="127.0.0.1:1")  # nothing listens there
    seen: list[list[TopicLag]] = []
    got_two = threading.Event()

    def update(lags):
        seen.append(lags)
        if len(seen) >= 2:
            got_two.set()

    monitor = LagMonitor(away, [GroupTopics("g", ("t",))], update, interval_s=0.2, timeout_s=1.0)
    monitor.start()
    try:
        assert got_two.wait(30), "no measurement reported"
    finally:
        monitor.close()
    assert seen[0] == [TopicLag("g", "t", None, None)]

    topic = topic_factory(partitions=1)
    _produce(kafka_settings, topic, 1, 3)
    live: list[list[TopicLag]] = []
    ok = LagMonitor(kafka_settings, [GroupTopics("fresh", (topic,))], live.append, interval_s=0.2)
    ok.start()
    try:
        deadline = time.monotonic() + 30
        while not live and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        ok.close()
    assert live and live[0][0].records == 3 and live[0][0].seconds >= AGE_S - 2
