"""The conversation table as a Faust table: each key written to its conversation's partition, stale keys dropped.

Upstream behaviour worked around (faust-streaming 0.15.3, ``faust/tables/base.py``):

- **where a key is written**: Faust's table writes a key to the changelog partition of the event being
  processed (``Collection.partition_for_key`` falls back to the current event's partition), or with
  ``use_partitioner`` to the hash of the whole key. Our key is ``[tenant, user, conversation]`` and a
  deletion read from ``chat.deletions`` would write elsewhere; so ``ConversationTable`` overrides
  ``partition_for_key`` with the conversation id's murmur2 partition (``streams/table.py``), the
  partition its prompts and responses arrive on (co-partitioned: one worker owns a conversation).
- **what a worker keeps after a rebalance**: Faust's in-memory store forgets, on revocation, only the
  keys it restored from the changelog, not the ones written while the partition was ours. After each
  recovery the keys of partitions no longer owned are dropped locally (``on_recovery_completed``), so a
  stale copy never comes back with the partition.
- **records on the wrong partition** (a changelog written by a chatpipe before this rule) are not
  replayed (``apply_changelog_batch``): an older value could win over a newer one.

Tests: tests/streams/test_conversation_table.py ``test_every_key_goes_to_its_conversation_ids_partition``,
``test_recovery_drops_the_keys_of_partitions_no_longer_owned``,
``test_a_restore_skips_records_on_another_partition_than_their_key``; the restart from the changelog in
tests/streams/test_pipeline.py.
"""

from __future__ import annotations

from typing import Any

from streams.table import key_partition


def conversation_table(app: Any, name: str, partitions: int, **kwargs: Any) -> Any:
    """A Faust table whose keys go to the changelog partition of their conversation id."""
    from faust.tables.table import Table

    class ConversationTable(Table):
        def partition_for_key(self, key: Any) -> int:
            return key_partition(key, partitions)

        async def on_recovery_completed(self, active_tps: Any, standby_tps: Any) -> None:
            await super().on_recovery_completed(active_tps, standby_tps)
            # Faust hands the table its changelog's partitions among active_tps
            changelog = self.changelog_topic.get_topic_name()
            owned = {tp.partition for tp in active_tps if tp.topic == changelog}
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


def placed_right(event: Any, partitions: int) -> bool:
    """Whether a changelog record sits on its key's conversation partition (an unreadable key is kept)."""
    try:
        return key_partition(event.key, partitions) == event.message.partition
    except (ValueError, TypeError, IndexError, KeyError):
        return True
