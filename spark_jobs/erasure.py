"""Whose rows a dataset holds, and which datasets an erasure affects (issue 19, contract C4).

Every row the finetune job writes to Parquet (``parquet/sft``, ``parquet/preference``,
``parquet/dropped``) carries:

- ``subject``: :func:`subject_key` of (tenant, user_id), a SHA-256 hex digest, so a dataset
  names no raw user id yet an erasure can find the user's rows;
- ``conversation_key``: :func:`conversation_key` of (tenant, user_id, conversation_id): the key
  every join, window and split of the job uses (a client-chosen ``chat-1`` of two tenants, or of
  two users, is two conversations);
- ``oldest_at``: epoch ms of the oldest record the row holds (the turn, the turns of its history,
  both sides of a pair), so "created at or before a deletion" can be asked of the row.

Both keys are ``schemas.subjects``' (the trainer's lineage carries them too); the Spark columns
(:func:`subject_column`, :func:`conversation_key_column`) compute exactly the Python values (tested).

Next to the dataset the job writes ``_chatpipe_dataset.json`` (:data:`MANIFEST`): when it was
built and which erasures it applied (subject, conversation key or null for the whole user, the
latest deletion time). :func:`affected_datasets` reads manifests and Parquet with pyarrow, no
Spark, and lists the datasets under a root that hold rows of a subject which no erasure applied
by their build covered. Datasets of the job written before subject keys existed have no
manifest: they are listed with ``rows=None`` (cannot tell: rebuild or delete them).

Not here: reading the deletions and excluding rows (``finetune_dataset.erased_rows``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from schemas.subjects import CONVERSATION_DOMAIN, SUBJECT_DOMAIN, conversation_key, subject_key

#: The file the finetune job writes into its output: build time, tables, erasures applied.
MANIFEST = "_chatpipe_dataset.json"
MANIFEST_FORMAT = 1
#: The Parquet tables of a dataset that hold rows with subject keys.
TABLES = ("parquet/sft", "parquet/preference", "parquet/dropped")
_JOB = "finetune-dataset"


def _encode_column(*cols):
    from pyspark.sql import functions as F

    return F.concat(*[piece for c in cols for piece in (F.octet_length(c).cast("string"), F.lit(":"), c)])


def subject_column(tenant: str = "tenant", user_id: str = "user_id"):
    """A Column: :func:`subject_key` of two string columns (null when either is null)."""
    from pyspark.sql import functions as F

    return F.sha2(F.concat(F.lit(SUBJECT_DOMAIN), _encode_column(F.col(tenant), F.col(user_id))), 256)


def conversation_key_column(tenant: str = "tenant", user_id: str = "user_id", conversation_id: str = "conversation_id"):
    """A Column: :func:`conversation_key` of three string columns (null when any is null)."""
    from pyspark.sql import functions as F

    return F.sha2(F.concat(F.lit(CONVERSATION_DOMAIN), _encode_column(
        F.col(tenant), F.col(user_id), F.col(conversation_id))), 256)


@dataclass(frozen=True)
class AffectedDataset:
    path: Path
    built_at_ms: int
    rows: int | None  # rows of the subject not covered by an erasure the build applied; None: cannot tell


@dataclass(frozen=True)
class AppliedErasure:
    subject: str
    conversation_key: str | None  # None: the whole user
    up_to_ms: int                 # records created at or before this were excluded


def write_manifest(folder: Path, built_at_ms: int, applied: list[AppliedErasure]) -> None:
    doc = {"job": _JOB, "format": MANIFEST_FORMAT, "built_at_ms": built_at_ms, "tables": list(TABLES),
           "erasures_applied": [{"subject": a.subject, "conversation_key": a.conversation_key, "up_to_ms": a.up_to_ms}
                                for a in sorted(applied, key=lambda a: (a.subject, a.conversation_key or ""))]}
    (Path(folder) / MANIFEST).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def _datasets(root: Path):
    """(folder, manifest dict or None) of every finetune output under ``root`` (``root`` included);
    temporary and replaced folders (names starting with ``.``) are skipped."""
    from spark_jobs.preflight import JOB_MARKER

    root = Path(root)
    if not root.is_dir():
        return
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        if MANIFEST in files:
            dirs[:] = []  # a dataset's own folders hold no other dataset
            yield Path(folder), json.loads((Path(folder) / MANIFEST).read_text(encoding="utf-8"))
        elif JOB_MARKER in files and (Path(folder) / JOB_MARKER).read_text(encoding="utf-8").strip() == _JOB:
            dirs[:] = []
            yield Path(folder), None


def _rows_of(folder: Path, table: str, subject: str):
    """(conversation_key, oldest_at) of ``subject``'s rows in one table (pyarrow, two columns read)."""
    import pyarrow.dataset as ds

    path = folder / table
    if not path.is_dir() or not any(path.rglob("*.parquet")):
        return []
    data = ds.dataset(str(path), format="parquet", partitioning="hive")
    got = data.to_table(columns=["conversation_key", "oldest_at"], filter=ds.field("subject") == subject)
    return list(zip(got.column("conversation_key").to_pylist(), got.column("oldest_at").to_pylist()))


def affected_datasets(root: Path, tenant: str, user_id: str, conversation_id: str | None = None,
                      erased_at_ms: int | None = None) -> list[AffectedDataset]:
    """Datasets under ``root`` holding rows of (tenant, user_id), or of that one conversation.

    A row counts unless an erasure the dataset's build applied already covers it (its manifest:
    the row is newer than that erasure, so the build kept it on purpose); with ``erased_at_ms``,
    only rows whose oldest record was created at or before it count (a deletion's ``created_at``:
    what that deletion must remove). Sorted by path.
    """
    subject = subject_key(tenant, user_id)
    wanted = None if conversation_id is None else conversation_key(tenant, user_id, conversation_id)
    out = []
    for folder, manifest in _datasets(root):
        if manifest is None:
            card = folder / "dataset_card.json"
            stamp = card if card.exists() else folder
            out.append(AffectedDataset(folder, int(stamp.stat().st_mtime * 1000), None))
            continue
        user_cut, conv_cut = None, {}
        for a in manifest.get("erasures_applied", []):
            if a["subject"] != subject:
                continue
            if a["conversation_key"] is None:
                user_cut = max(user_cut or a["up_to_ms"], a["up_to_ms"])
            else:
                conv_cut[a["conversation_key"]] = max(conv_cut.get(a["conversation_key"], a["up_to_ms"]), a["up_to_ms"])
        rows = 0
        for table in manifest.get("tables", TABLES):
            for conv, oldest in _rows_of(folder, table, subject):
                if wanted is not None and conv != wanted:
                    continue
                cut = max((c for c in (user_cut, conv_cut.get(conv)) if c is not None), default=None)
                if cut is not None and oldest is not None and oldest > cut:
                    continue  # kept by a build that applied this subject's erasure: newer than it
                if erased_at_ms is not None and oldest is not None and oldest > erased_at_ms:
                    continue
                rows += 1
        if rows:
            out.append(AffectedDataset(folder, int(manifest["built_at_ms"]), rows))
    return sorted(out, key=lambda a: str(a.path))
