"""The one partitioning rule of chatpipe: Kafka's murmur2 of the record key, modulo the partition count.

Every producer of the project uses it (librdkafka's ``partitioner=murmur2_random``; Faust/aiokafka's
``DefaultPartitioner`` and every Java client's default partitioner are the same function), so a
conversation's prompts, inference requests, responses, turns and its row of the streams tier's
conversation table all live on the same partition number, whichever client produced them
(docs/producing.md "Keys and partitions"). Without it librdkafka's default (CRC32) put one
conversation on two partitions.
"""

from __future__ import annotations

from aiokafka.partitioner import murmur2

#: librdkafka's name of the rule (``partitioner`` producer property): murmur2 of the key like the Java
#: client; a record without a key goes to a random partition.
LIBRDKAFKA_PARTITIONER = "murmur2_random"


def partition_of(key: bytes | str, partitions: int) -> int:
    """The partition Kafka's default partitioner (``Utils.toPositive(Utils.murmur2(key)) % n``) picks."""
    if partitions < 1:
        raise ValueError(f"a topic has at least one partition, not {partitions}")
    data = key.encode() if isinstance(key, str) else key
    return (murmur2(data) & 0x7FFFFFFF) % partitions
