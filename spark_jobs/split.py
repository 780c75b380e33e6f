"""Train/validation split by conversation: every turn of a conversation lands in one split.

The split is a pure function of the conversation's key (``erasure.conversation_key``: tenant,
user and conversation id hashed together; first 32 bits of the key's SHA-256, mod 10,000,
against ``validation_fraction``), so it is the same on every run, source, Spark version and
machine, and a conversation's examples never straddle train and validation. Not the client's
``conversation_id`` alone: two tenants' ``chat-1`` are two conversations and split independently.
"""

from __future__ import annotations

BUCKETS = 10_000


def split_column(validation_fraction: float, key: str = "conversation_key"):
    """A Column: the split of the conversation whose key (``erasure.conversation_key``) is column ``key``."""
    from pyspark.sql import functions as F

    bucket = F.conv(F.substring(F.sha2(F.col(key), 256), 1, 8), 16, 10).cast("long") % BUCKETS
    return F.when(bucket < F.lit(validation_fraction * BUCKETS), "validation").otherwise("train")
