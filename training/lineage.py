"""Which rows a run trains on, and whose they are: the dataset's lineage, the tenant scope, erasures.

The dataset job writes each split twice in the same order: ``sft/train.jsonl`` (what the processes read;
``preference/`` for DPO, likewise) and ``parquet/sft/split=train`` (the same rows with their tenant, subject and conversation hashes, the
request and trace ids of every turn they hold, and ``oldest_at``). :func:`read_lineage` reads the Parquet
and checks it row by row against the JSONL (the same messages), so line ``i`` of the JSONL is row ``i``.

:func:`select_rows` decides, once, before any process starts, which lines the run trains on:

- **tenant scope**: one tenant's rows train only that tenant's adapters (``--tenant T`` keeps T's lines);
  a dataset of several tenants trains one adapter for all only when declared shared (``--shared-data``);
- the same rules choose the validation split's lines the eval loss reads;
- **erasures**: a line holding a record of an erased user (or conversation) made at or before the
  erasure is left out, whether or not the dataset's build knew of that erasure (``chat.deletions`` is
  read when the run starts). This is how a tainted version is rebuilt without the erased rows.

The selection is written to the run folder (``selection.json``), so every process and a resumed run
train on exactly the same lines; the version's ``lineage.parquet`` is the lineage of those lines only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from schemas.models import LINEAGE_COLUMNS
from schemas.records import Deletion, DeletionScope
from schemas.subjects import conversation_key, subject_key
from training.sft_data import DatasetError

SELECTION_FILE = "selection.json"


def _parquet_split(split: str, table: str = "sft") -> Path:
    return Path("parquet") / table / f"split={split}"


@dataclass(frozen=True)
class Erasures:
    """Newest deletion time per subject hash, and per conversation hash (from ``chat.deletions``)."""

    users: dict[str, int] = field(default_factory=dict)
    conversations: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, deletions: Iterable[Deletion]) -> "Erasures":
        users: dict[str, int] = {}
        conversations: dict[str, int] = {}
        for d in deletions:
            if d.scope == DeletionScope.USER:
                key = subject_key(d.tenant, d.user_id)
                users[key] = max(users.get(key, 0), d.created_at)
            elif d.conversation_id:
                key = conversation_key(d.tenant, d.user_id, d.conversation_id)
                conversations[key] = max(conversations.get(key, 0), d.created_at)
        return cls(users, conversations)

    def erased(self, subject: str, conversation: str, oldest_at: int | None) -> bool:
        """Whether a row holding records from ``oldest_at`` on falls under a deletion (a row without a
        time is taken as old: kept out rather than kept)."""
        cut = max(self.users.get(subject, -1), self.conversations.get(conversation, -1))
        return cut >= 0 and (oldest_at is None or oldest_at <= cut)


@dataclass(frozen=True)
class Selection:
    """The lines of ``sft/train.jsonl`` a run trains on, and what was left out, by reason."""

    lines: list[int]
    tenants: list[str]  # of the lines kept
    tenant: str | None  # the scope: the one tenant, or None (shared data)
    left_out: dict[str, int] = field(default_factory=dict)  # reason -> lines
    validation_lines: list[int] | None = None  # the same rules on sft/validation.jsonl; None: all of it

    def write(self, run: Path) -> None:
        doc = {"lines": self.lines, "tenants": self.tenants, "tenant": self.tenant, "left_out": self.left_out,
               "validation_lines": self.validation_lines}
        (Path(run) / SELECTION_FILE).write_text(json.dumps(doc))

    @classmethod
    def read(cls, run: Path) -> "Selection | None":
        path = Path(run) / SELECTION_FILE
        if not path.is_file():
            return None
        doc = json.loads(path.read_text())
        return cls(doc["lines"], doc["tenants"], doc["tenant"], doc.get("left_out", {}), doc.get("validation_lines"))


def erasures_on_broker(kafka: Any) -> Erasures:
    """Every deletion on ``chat.deletions`` now (the topic is kept forever: the source of truth)."""
    from transport.deletion_log import read_deletions

    return Erasures.of(read_deletions(kafka))


def has_lineage(dataset: Path, table: str = "sft") -> bool:
    return (Path(dataset) / _parquet_split("train", table)).is_dir()


def validation_lineage(dataset: Path, table: str = "sft"):
    """The validation split's lineage; None when the split is empty (no Parquet file: no rows)."""
    if not any((Path(dataset) / _parquet_split("validation", table)).glob("*.parquet")):
        return None
    return read_lineage(dataset, "validation", table)


#: Per table: the Parquet columns that hold what a JSONL line holds, and how to read both as one list of
#: (role, content): the SFT conversation; a pair's prompt with its chosen answer (the rejected one is in
#: the same row of both: one check suffices).
_CONTENT = {
    "sft": (["messages"], lambda row: row["messages"], lambda line: line["messages"]),
    "preference": (["prompt_messages", "chosen"], lambda row: row["prompt_messages"] + row["chosen"],
                   lambda line: line["input"]["messages"] + line["preferred_output"]),
}


def read_lineage(dataset: Path, split: str = "train", table: str = "sft"):
    """A split's lineage (a pyarrow Table: LINEAGE_COLUMNS), row ``i`` = line ``i`` of ``<table>/<split>.jsonl``
    (``sft`` or ``preference``); DatasetError when the dataset has no Parquet or the two disagree."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = Path(dataset) / _parquet_split(split, table)
    files = sorted(folder.glob("*.parquet"))
    if not files:
        raise DatasetError(f"no lineage in {dataset}: {_parquet_split(split, table)}/*.parquet is missing (a dataset "
                           "made by `chatpipe job finetune-dataset` has it); train without publishing: --no-publish")
    content_columns, of_row, of_line = _CONTENT[table]
    data = pa.concat_tables(pq.read_table(f, columns=["tenant", "subject", "conversation_key", "oldest_at",
                                                      "request_ids", "trace_ids", *content_columns]) for f in files)
    jsonl = Path(dataset) / table / f"{split}.jsonl"
    with open(jsonl, encoding="utf-8") as lines:
        rows = [of_line(json.loads(line)) for line in lines if line.strip()]
    if len(rows) != data.num_rows:
        raise DatasetError(f"{jsonl} has {len(rows)} examples, its Parquet {data.num_rows}: not one build")
    for i, (line, row) in enumerate(zip(rows, data.select(content_columns).to_pylist())):
        if [(m["role"], m["content"]) for m in line] != [(m["role"], m["content"]) for m in of_row(row)]:
            raise DatasetError(f"{jsonl}: line {i + 1} is not row {i} of {folder}: not one build")
    data = data.drop(content_columns).append_column("line", pa.array(range(data.num_rows), pa.int32()))
    return data.select(list(LINEAGE_COLUMNS))


def select_rows(lineage: Any, tenant: str | None, shared: bool, erasures: Erasures,
                validation: Any = None) -> Selection:
    """The lines to train on (see the module docstring), and of ``validation`` (its lineage) to evaluate on;
    DatasetError when nothing is left or the tenant scope is not said."""
    tenants = lineage.column("tenant").to_pylist()
    present = sorted(set(tenants))
    if tenant is None and not shared and len(present) > 1:
        raise DatasetError(f"the dataset holds rows of {len(present)} tenants ({', '.join(present)}): one tenant's "
                           "data trains only that tenant's adapters. Train one with --tenant T, or declare the data "
                           "shared with --shared-data")
    if tenant is not None and tenant not in present:
        raise DatasetError(f"the dataset has no rows of tenant {tenant!r} (it has: {', '.join(present)})")
    scope = tenant if tenant is not None else (present[0] if not shared and present else None)
    keep, left_out = _kept(lineage, scope, erasures)
    if not keep:
        raise DatasetError(f"no example of the dataset is left to train on ({left_out})")
    return Selection(keep, sorted({tenants[i] for i in keep}), scope, {k: v for k, v in left_out.items() if v},
                     None if validation is None else _kept(validation, scope, erasures)[0])


def _kept(lineage: Any, scope: str | None, erasures: Erasures) -> tuple[list[int], dict[str, int]]:
    """The lines of a split in the scope and not erased, and how many were left out by reason."""
    keep, left_out = [], {"other tenant": 0, "erased": 0}
    for line, row_tenant, subject, conv, oldest in zip(
            *(lineage.column(c).to_pylist() for c in ("line", "tenant", "subject", "conversation_key", "oldest_at"))):
        if scope is not None and row_tenant != scope:
            left_out["other tenant"] += 1
        elif erasures.erased(subject, conv, oldest):
            left_out["erased"] += 1
        else:
            keep.append(line)
    return keep, left_out


def selected_lineage(lineage: Any, selection: Selection):
    """The lineage rows of the selected lines only (what lineage.parquet of the version holds)."""
    return lineage.take(selection.lines)
