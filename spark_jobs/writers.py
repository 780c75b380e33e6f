"""Job outputs, written atomically and reproducibly.

:func:`atomic_output` yields a temporary folder beside the target (``.<name>.tmp-<uuid>``);
only when the job finished is it renamed to the target (an old target, with ``overwrite``, is
renamed away first and deleted after). A crashed run leaves the old output untouched and a
``.tmp-`` folder to delete.

Reproducible: JSONL lines are produced in a fixed order (the rows are sorted by stable keys)
and serialised in the JVM (``to_json``); Parquet is one file per table or per split, sorted,
renamed from Spark's random ``part-<uuid>`` to ``part-00000``.

Fast on one machine: each table is one Spark job. Rows go to one partition and are sorted
there (``repartition(1).sortWithinPartitions``), which gives one file without the sampling
job a global ``orderBy`` runs first; the partition column leads the sort key, so Spark's
writer needs no sort of its own. JSONL of all splits is written by Spark's text writer in one
job (streamed to disk, never collected into the driver) and moved into place.
Rerunning on the same input gives byte-identical JSONL and card, and Parquet files with the
same rows in the same order.

Outputs go to a filesystem path this process can rename (local disk, or a shared mount on a
cluster); object stores would need a committer instead of rename.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path

from pyspark.sql import DataFrame
from pyspark.sql import functions as F



@contextmanager
def atomic_output(out: Path):
    """The temporary folder of ``out``, renamed over it at the end; whether ``out`` may be replaced
    is checked before (``preflight.check_output``, the one caller's)."""
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _sorted_one_partition(df: DataFrame, keys: list[str]) -> DataFrame:
    return df.repartition(1).sortWithinPartitions(*keys)


def write_jsonl(df: DataFrame, order: list[str], columns: list[str], paths: dict[str, Path],
                split_col: str = "split") -> dict[str, int]:
    """``columns`` of ``df`` as one JSON object per line, in ``order``, a file per ``split_col``
    value (``paths``: value -> file; a value without rows gets an empty file); returns line counts."""
    staging = next(iter(paths.values())).parent / "_jsonl_staging"
    lines = _sorted_one_partition(df, [split_col, *order]).select(
        split_col, F.to_json(F.struct(*columns)).alias("value"))
    lines.write.mode("overwrite").partitionBy(split_col).text(str(staging))
    counts = {}
    for value, path in paths.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        parts = sorted((staging / f"{split_col}={value}").glob("part-*"))
        assert len(parts) <= 1, parts  # one partition -> at most one file per value
        if parts:
            os.replace(parts[0], path)
        else:
            path.write_bytes(b"")
        with open(path, "rb") as fh:
            counts[value] = sum(chunk.count(b"\n") for chunk in iter(lambda: fh.read(1 << 20), b""))
    shutil.rmtree(staging)
    return counts


def write_parquet(df: DataFrame, order: list[str], path: Path, partition_by: str | None = None) -> None:
    """``df`` sorted by ``order`` as Parquet, one deterministically named file per partition value."""
    keys = [partition_by, *order] if partition_by else order
    writer = _sorted_one_partition(df, keys).write.mode("overwrite")
    if partition_by:
        writer = writer.partitionBy(partition_by)
    writer.parquet(str(path))
    for folder in [path, *[p for p in path.rglob("*") if p.is_dir()]]:
        for junk in list(folder.glob("_*")) + list(folder.glob(".*.crc")):
            junk.unlink()
        for i, part in enumerate(sorted(folder.glob("part-*.parquet"))):
            part.rename(folder / f"part-{i:05d}.parquet")


def write_json(obj, path: Path) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
