"""Typed, frozen settings of the batch jobs, built once by the CLI (flags + environment).

``SparkSettings`` is shared by both jobs (where Spark runs); ``FinetuneSettings`` and
``UsageReportSettings`` hold what one job does; ``DatasetStoreSettings`` says where datasets are
kept (searched by erasure checks). Kafka connection settings are the
transport's ``KafkaSettings``. No module here reads the environment itself: pydantic-settings
does it when the CLI builds these objects (``CHATPIPE_SPARK_*``, ``CHATPIPE_FINETUNE_*``,
``CHATPIPE_USAGE_*``, ``CHATPIPE_DATASETS_*``).
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.topics import DELETIONS, DLQ, FEEDBACK, TURNS

def parse_time_ms(value: str | int | datetime | None) -> int | None:
    """Epoch ms from an int, an ISO-8601 string (naive = UTC) or a datetime."""
    if value is None or isinstance(value, int):
        return value
    if isinstance(value, str):
        if value.strip().lstrip("-").isdigit():
            return int(value)
        value = datetime.fromisoformat(value)
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return int(value.timestamp() * 1000)


#: Epoch ms, given as an int, an ISO-8601 string (naive = UTC) or a datetime.
TimeMs = Annotated[int | None, BeforeValidator(parse_time_ms)]


class SparkSettings(BaseSettings):
    """Where and how Spark runs; ``conf`` passes any ``spark.*`` setting through."""

    model_config = SettingsConfigDict(env_prefix="CHATPIPE_SPARK_", frozen=True, extra="forbid")

    master: str = Field("local[*]", description="Spark master URL: local[*], spark://..., yarn, k8s://...")
    app_name: str = Field("chatpipe", description="Spark application name")
    conf: dict[str, str] = Field(default_factory=dict, description="Extra Spark conf, k=v")
    shuffle_partitions: int = Field(8, gt=0, description="spark.sql.shuffle.partitions unless in conf")
    jars_cache_dir: Path = Field(Path("~/.cache/chatpipe/spark-jars").expanduser(),
                                 description="Where the connector jars from Maven Central are kept")
    progress: bool = Field(True, description="Show a progress display per step")
    class_data_sharing: bool = Field(True, description="Map the driver JVM's classes from a cached CDS archive (faster start)")
    jvm_functions: bool = Field(True, description="Compute n-gram hashes (decontam, MinHash) and quality's text count with the project's Java functions (built with javac on first use); off: the same results in Spark SQL, slower")
    jit: Literal["auto", "client", "server"] = Field("auto", description="JIT of the driver JVM (in local mode it runs the tasks too): client = C1 only (compiles less; small inputs), server = C1+C2 (faster code; long jobs), auto = server from 32 MiB of archive input")


class _InputSettings(BaseSettings):
    source: Literal["kafka", "archive"] = Field("kafka", description="Read from Kafka (bounded batch) or from the Avro archive")
    archive_dir: Path | None = Field(None, description="Root folder of the Avro archive (source=archive)")
    since: TimeMs = Field(None, description="Start of the time range (Kafka timestamp), ISO-8601 (UTC) or epoch ms, inclusive")
    until: TimeMs = Field(None, description="End of the time range, ISO-8601 (UTC) or epoch ms, exclusive")
    out: Path = Field(..., description="Output folder, written atomically")
    overwrite: bool = Field(False, description="Replace an existing output folder, if it holds a previous output of the same job")

    @model_validator(mode="after")
    def _check(self):
        if self.source == "archive" and self.archive_dir is None:
            raise ValueError("source=archive needs archive_dir")
        if self.since is not None and self.until is not None and self.since >= self.until:
            raise ValueError("since must be before until")
        return self


class FinetuneSettings(_InputSettings):
    """What ``chatpipe job finetune-dataset`` does; every threshold is a field here."""

    model_config = SettingsConfigDict(env_prefix="CHATPIPE_FINETUNE_", frozen=True, extra="forbid")

    turns_topic: str = Field(TURNS, description="Catalog name of the turns topic (prefix added)")
    feedback_topic: str = Field(FEEDBACK, description="Catalog name of the feedback topic")
    deletions_topic: str = Field(DELETIONS, description="Catalog name of the deletions topic: erased users and conversations are left out (read from the archive folder, and from Kafka for a Kafka source)")
    eval_files: tuple[Path, ...] = Field((), description="Eval sets to decontaminate against (.jsonl/.txt)")
    decontam_ngram: int = Field(13, ge=3, description="Words per n-gram shared with an eval set that drops an example")
    min_answer_chars: int = Field(8, ge=0, description="Shorter answers are dropped (too_short)")
    min_prompt_chars: int = Field(2, ge=0, description="Shorter prompts are dropped (too_short)")
    max_chars: int = Field(20_000, gt=0, description="Longer prompt+answer is dropped (too_long)")
    min_text_ratio: float = Field(0.6, ge=0, le=1, description="Least share of text (letters, digits, whitespace, prose punctuation) in the answer")
    max_dup_line_ratio: float = Field(0.3, ge=0, le=1, description="Most share of repeated non-empty lines")
    near_dup_threshold: float = Field(0.8, gt=0, le=1, description="Jaccard similarity at or above which turns are near-duplicates")
    near_dup_ngram: int = Field(3, ge=1, description="Words per shingle for MinHash")
    near_dup_hash_tables: int = Field(5, ge=1, description="MinHashLSH numHashTables (more = better recall, slower)")
    validation_fraction: float = Field(0.05, ge=0, lt=1, description="Share of conversations in validation")
    max_context_tokens: int = Field(2048, gt=0, description="Token budget of one example incl. earlier turns")
    default_system_prompt: str | None = Field(None, description="System message when a turn has none")
    seed: int = Field(1234, description="Seed of MinHashLSH's hash functions")
    write_dropped: bool = Field(True, description="Write the dropped records with their reason")


class DatasetStoreSettings(BaseSettings):
    """Where datasets are kept, for erasure: ``spark_jobs.erasure.affected_datasets`` (and
    ``chatpipe forget --verify``) search this folder; write the finetune job's ``--out`` under it."""

    model_config = SettingsConfigDict(env_prefix="CHATPIPE_DATASETS_", frozen=True, extra="forbid")

    root: Path = Field(Path(".chatpipe/datasets"), description="Folder holding the fine-tuning datasets (searched for an erased user's rows)")


class UsageReportSettings(_InputSettings):
    """What ``chatpipe job usage-report`` does."""

    model_config = SettingsConfigDict(env_prefix="CHATPIPE_USAGE_", frozen=True, extra="forbid")

    turns_topic: str = Field(TURNS, description="Catalog name of the turns topic")
    dlq_topic: str = Field(DLQ, description="Catalog name of the dead-letter topic")
    charts: bool = Field(True, description="Write PNG charts")
