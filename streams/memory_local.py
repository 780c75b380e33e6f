"""Qdrant local mode, laid out and tuned for conversation memory (used by ``streams.memory``).

For: which local collection holds a (tenant, user) pair, and the SQLite setting that makes local
upserts affordable. Not for: server mode, which keeps one collection with payload indexes.

Why partitions: local mode evaluates a payload filter in Python for every point of a collection
(~13 us per point on our 2-core VM), so a tenant+user recall over one collection of 100k turns
took ~1.3 s (bench/memory.py --baseline-queries). Hashing each (tenant, user) pair to one of N
collections makes a recall filter ~1/N of the points, plus that user's own turns.

Why the SQLite tuning: local mode persists every point in its own SQLite transaction; with the
default rollback journal each commit is an fsync (~1 ms), which capped upserts at ~800 points/s,
16% of the embedding model's time per turn. Write-ahead logging with ``synchronous=NORMAL``
(commits survive a crash of the process, the last ones may be lost if the machine loses power;
the turns are still in ``chat.turns`` and the archive) measured 2.5-10x faster upserts and 4-5x
less CPU per point here. qdrant-client has no option for it, so it is set on the connection
qdrant-client opened; if a future qdrant-client stores points differently, ``tune_storage``
returns False and only speed is lost (tests/streams/test_memory.py checks it still applies).

Open files: each partition's SQLite file holds 3 descriptors in WAL mode (the file, -wal, -shm),
768 for the default 256 partitions, near the common soft limit of 1024; ``open_files_problem``
lifts the soft limit towards the hard one at start.
"""

from __future__ import annotations

import hashlib
import resource
import sqlite3

from qdrant_client import QdrantClient


def partition_prefix(collection: str, partitions: int) -> str:
    """Names are ``<collection>.<partitions>.<i>``: the count is in the name, so a folder written
    with another ``local_partitions`` is recognised instead of silently searched in the wrong place."""
    return f"{collection}.{partitions}."


def partition_of(collection: str, partitions: int, tenant: str, user_id: str) -> str:
    """The collection holding this tenant's user: stable across processes and machines."""
    # blake2b, not hash(): Python's string hash changes per process
    digest = hashlib.blake2b(f"{tenant}\x1f{user_id}".encode(), digest_size=8).digest()
    return f"{partition_prefix(collection, partitions)}{int.from_bytes(digest, 'big') % partitions}"


def stored_partitions(client: QdrantClient, collection: str) -> set[str]:
    """Every local collection of this memory, of any partition count."""
    return {c.name for c in client.get_collections().collections if c.name.startswith(f"{collection}.")}


def tune_storage(client: QdrantClient, name: str) -> bool:
    """WAL journal + synchronous=NORMAL on the SQLite file of local collection ``name``."""
    local = getattr(client, "_client", None)  # QdrantLocal behind the public client
    collection = getattr(local, "collections", {}).get(name)
    connection = getattr(getattr(collection, "storage", None), "storage", None)
    if not isinstance(connection, sqlite3.Connection):
        return False
    connection.execute("PRAGMA journal_mode=WAL")  # persistent: stored in the file itself
    connection.execute("PRAGMA synchronous=NORMAL")  # per connection: set at every open
    return True


FILES_PER_PARTITION = 3  # SQLite file, its -wal and its -shm, all kept open
FILES_HEADROOM = 512  # Kafka sockets, model files, logs of the rest of the process


def open_files_problem(partitions: int) -> str | None:
    """Lift the soft RLIMIT_NOFILE so every partition can be open at once; say why not if it can't
    (the hard limit needs privileges to raise)."""
    needed = partitions * FILES_PER_PARTITION + FILES_HEADROOM
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return None
    target = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target >= needed:
        return None
    return (f"local mode with {partitions} partitions needs ~{needed} open files, the process may open "
            f"{target}: lower CHATPIPE_MEMORY_LOCAL_PARTITIONS or raise `ulimit -n`")
