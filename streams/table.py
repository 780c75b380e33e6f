"""The conversation table, partitioned like the conversation's own records.

Every record of a conversation is keyed by its conversation id and placed by Kafka's murmur2 rule
(``transport/partitioning.py``, docs/producing.md): its prompts, inference requests, responses, turns and
feedback all sit on partition ``murmur2(conversation_id) % 6``. The table's key is
``[tenant, user, conversation]`` (``state.state_key``: another tenant reusing an id never sees these
turns), so Faust's own choices do not fit: its default writes a key to the partition of the event being
processed (a deletion read from ``chat.deletions`` would write elsewhere), and ``use_partitioner`` hashes
the whole key. ``ConversationTable`` writes each key to the partition of its **conversation id**, so:

- the worker that owns partition ``p`` of ``chat.prompts`` also owns ``p`` of ``chat.responses``,
  ``chat.turns`` and the changelog (Faust's assignor gives co-partitioned topics, same partition count,
  to the same worker), and every key it reads or writes is one of its own;
- after a rebalance the new owner restores exactly those keys from the changelog, in write order.

And it drops, after each recovery, the keys of partitions it no longer owns (Faust's in-memory store
forgets only the keys it restored, not those written while the partition was ours): a stale copy
must not come back when the partition does, e.g. of a conversation forgotten meanwhile whose
tombstone compaction has removed. A changelog record found on another partition than its key's
(written by a chatpipe before this rule) is not replayed: the conversation's state then starts
again (its recent window; a response still in flight for it is dead-lettered as unknown).
"""

from __future__ import annotations

import json
from typing import Any

from transport.partitioning import partition_of


def conversation_of(key: str) -> str:
    """The conversation id of a table key (``state.state_key``)."""
    return json.loads(key)[2]


def key_partition(key: str, partitions: int) -> int:
    return partition_of(conversation_of(key), partitions)


def conversation_table(app: Any, name: str, partitions: int, **kwargs: Any) -> Any:
    """A Faust table whose keys go to the changelog partition of their conversation id."""
    from faust.tables.table import Table

    class ConversationTable(Table):
        def partition_for_key(self, key: Any) -> int:
            return key_partition(key, partitions)

        async def on_recovery_completed(self, active_tps: Any, standby_tps: Any) -> None:
            await super().on_recovery_completed(active_tps, standby_tps)
            owned = owned_partitions(active_tps, self.changelog_topic.get_topic_name())
            for key in [k for k in list(self.data.keys()) if key_partition(k, partitions) not in owned]:
                self.data.pop(key, None)  # local only: the changelog (and its new owner) keep it

        def apply_changelog_batch(self, batch: Any) -> None:
            # A record on another partition than its key's was written before this rule (a changelog of
            # an older chatpipe, which hashed the whole key): replayed with the rest, an older value
            # could win over a newer one on the right partition. Such a state is dropped instead.
            events = list(batch)
            kept = [event for event in events if placed_right(event, partitions)]
            self.misplaced_dropped += len(events) - len(kept)
            super().apply_changelog_batch(kept)

    table = ConversationTable(app, name=name, default=None, beacon=app.tables.beacon, partitions=partitions,
                              **kwargs)
    table.misplaced_dropped = 0
    return app.tables.add(table)


def owned_partitions(active_tps: Any, changelog: str) -> set[int]:
    """The changelog partitions among ``active_tps`` (Faust hands the table its changelog's partitions)."""
    return {tp.partition for tp in active_tps if tp.topic == changelog}


def placed_right(event: Any, partitions: int) -> bool:
    """Whether a changelog record sits on its key's conversation partition (an unreadable key is kept)."""
    try:
        return key_partition(event.key, partitions) == event.message.partition
    except (ValueError, TypeError, IndexError, KeyError):
        return True
