"""Train/validation split by conversation: every turn of a conversation lands in one split.

The split is a pure function of ``conversation_id`` (first 32 bits of its SHA-256, mod
10,000, against ``validation_fraction``), so it is the same on every run, source, Spark
version and machine, and a conversation's examples never straddle train and validation.
"""

from __future__ import annotations

import hashlib

BUCKETS = 10_000


def split_of(conversation_id: str, validation_fraction: float) -> str:
    bucket = int(hashlib.sha256(conversation_id.encode()).hexdigest()[:8], 16) % BUCKETS
    return "validation" if bucket < validation_fraction * BUCKETS else "train"


def split_column(validation_fraction: float):
    """A Column: ``split_of(conversation_id)`` in the JVM."""
    from pyspark.sql import functions as F

    bucket = F.conv(F.substring(F.sha2(F.col("conversation_id"), 256), 1, 8), 16, 10).cast("long") % BUCKETS
    return F.when(bucket < F.lit(validation_fraction * BUCKETS), "validation").otherwise("train")
