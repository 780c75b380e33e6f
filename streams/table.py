"""The conversation table's keys and their partition rule.

Every record of a conversation is keyed by its conversation id and placed by Kafka's murmur2 rule
(``transport/partitioning.py``, docs/producing.md): its prompts, inference requests, responses, turns and
feedback all sit on partition ``murmur2(conversation_id) % 6``. The table's key is
``[tenant, user, conversation]`` (``state.state_key``: another tenant reusing an id never sees these
turns), so Faust's own choices do not fit: its default writes a key to the partition of the event being
processed (a deletion read from ``chat.deletions`` would write elsewhere), and ``use_partitioner`` hashes
the whole key. ``ConversationTable`` (``streams/faust_runtime/table.py``) writes each key to the
partition of its **conversation id** (``key_partition``), so the worker that owns partition ``p`` of
``chat.prompts`` also owns ``p`` of ``chat.responses``, ``chat.turns`` and the changelog (Faust's
assignor gives co-partitioned topics, same partition count, to the same worker), and every key it reads
or writes is one of its own; after a rebalance the new owner restores exactly those keys.
"""

from __future__ import annotations

import json

from transport.partitioning import partition_of


def conversation_of(key: str) -> str:
    """The conversation id of a table key (``state.state_key``)."""
    return json.loads(key)[2]


def key_partition(key: str, partitions: int) -> int:
    return partition_of(conversation_of(key), partitions)
