"""The hashes that name a user and a conversation in datasets and model lineage, without the raw ids.

``subject_key(tenant, user_id)`` and ``conversation_key(tenant, user_id, conversation_id)`` are SHA-256
hex digests of a length-prefixed encoding (``<utf-8 length>:<value>`` per part, after a domain prefix), so
no choice of ids makes two different tuples collide by concatenation. The dataset job writes them on every
row (its Spark columns compute the same values: spark_jobs/erasure.py), the trainer copies them into a
version's lineage, and an erasure finds a user's rows by them. Not keyed: someone holding a dataset and
guessing a (tenant, user) pair can confirm it; what it prevents is a dataset that lists user ids in the clear.
"""

from __future__ import annotations

import hashlib

SUBJECT_DOMAIN = "chatpipe.subject|"
CONVERSATION_DOMAIN = "chatpipe.conversation|"


def encode_parts(*parts: str) -> str:
    return "".join(f"{len(p.encode('utf-8'))}:{p}" for p in parts)


def subject_key(tenant: str, user_id: str) -> str:
    """The stable hash naming (tenant, user_id) in datasets (hex SHA-256)."""
    return hashlib.sha256((SUBJECT_DOMAIN + encode_parts(tenant, user_id)).encode("utf-8")).hexdigest()


def conversation_key(tenant: str, user_id: str, conversation_id: str) -> str:
    """The stable hash naming one conversation of one user of one tenant (hex SHA-256)."""
    return hashlib.sha256((CONVERSATION_DOMAIN + encode_parts(tenant, user_id, conversation_id)).encode("utf-8")).hexdigest()
