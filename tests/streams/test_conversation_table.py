"""The conversation table's partitioning (streams/table.py) on a real Faust table (an app that is built,
never started: nothing connects): writes go to the conversation id's partition, a restore skips
records written elsewhere by an older rule, a recovery drops keys of partitions no longer owned."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import namedtuple
from types import SimpleNamespace

from streams.state import state_key
from streams.faust_runtime.table import conversation_table
from streams.table import key_partition
from transport.partitioning import partition_of

TP = namedtuple("TP", "topic partition")


def table():
    import faust

    app = faust.App(f"table-{uuid.uuid4().hex[:6]}", broker="kafka://127.0.0.1:1", autodiscover=False,
                    store="memory://")
    return conversation_table(app, "conversations", 6)


def record(key: str, partition: int, value: dict | None):
    raw = None if value is None else json.dumps(value).encode()
    return SimpleNamespace(key=key, value=value, message=SimpleNamespace(partition=partition, value=raw))


def test_every_key_goes_to_its_conversation_ids_partition():
    t = table()
    for i in range(200):
        key = state_key(f"tenant-{i % 3}", f"user-{i}", f"conv-{i}")
        assert t.partition_for_key(key) == partition_of(f"conv-{i}", 6) == key_partition(key, 6)
    # the tenant and user do not move a conversation: all its keys share the partition of its prompts
    assert len({t.partition_for_key(state_key(f"t{i}", f"u{i}", "same-conv")) for i in range(50)}) == 1


def test_a_restore_skips_records_on_another_partition_than_their_key():
    t = table()
    key = state_key("acme", "ada", "c1")
    right = key_partition(key, 6)
    wrong = (right + 1) % 6
    t.apply_changelog_batch([record(key, right, {"turn_count": 3}), record(key, wrong, {"turn_count": 1})])
    assert t.data[key] == {"turn_count": 3} and t.misplaced_dropped == 1


def test_recovery_drops_the_keys_of_partitions_no_longer_owned():
    t = table()
    keys = [state_key("acme", "ada", f"c{i}") for i in range(30)]
    for key in keys:
        t.data[key] = {"x": 1}  # written while this worker owned every partition
    owned = {0, 1, 2}
    changelog = t.changelog_topic.get_topic_name()
    asyncio.run(t.on_recovery_completed({TP(changelog, p) for p in owned} | {TP("other-topic", 5)}, set()))
    assert set(t.data.keys()) == {k for k in keys if key_partition(k, 6) in owned}
    assert any(key_partition(k, 6) not in owned for k in keys), "the test needs keys of other partitions"
