"""``jit=auto``: the driver JVM gets the client JIT (C1 only) for small inputs and the server JIT for
large ones, judged by the archive bytes the job will read (no Spark started here)."""

from __future__ import annotations

import pytest

from spark_jobs.preflight import input_bytes
from spark_jobs.session import SERVER_JIT_FROM_BYTES, session_conf
from spark_jobs.settings import FinetuneSettings, SparkSettings, UsageReportSettings
from transport.settings import KafkaSettings

C1_ONLY = "-XX:TieredStopAtLevel=1"


def _java_options(settings: SparkSettings, size: int | None) -> str:
    return session_conf(settings, size)["spark.driver.extraJavaOptions"]


@pytest.mark.parametrize("jit, size, c1_only", [
    ("auto", None, True),  # Kafka: size unknown, the small-input choice
    ("auto", SERVER_JIT_FROM_BYTES - 1, True),
    ("auto", SERVER_JIT_FROM_BYTES, False),
    ("client", 10 * SERVER_JIT_FROM_BYTES, True),
    ("server", 1, False),
])
def test_jit_choice(jit, size, c1_only):
    """Catches the C1-only flag on a large input (measured slower there) or missing on a small one."""
    assert (C1_ONLY in _java_options(SparkSettings(jit=jit, class_data_sharing=False), size)) is c1_only


def test_input_bytes_counts_the_jobs_topics_in_range(tmp_path):
    """Catches sizing by the wrong topics or ignoring the time range: the finetune job reads turns +
    feedback, the usage report turns + dead letters, each only in hour folders of its range."""
    root = tmp_path / "archive"
    sizes = {("chat.turns", "2026-01-01", "00"): 100, ("chat.turns", "2026-01-02", "00"): 1000,
             ("chat.feedback", "2026-01-01", "00"): 10, ("chat.dlq", "2026-01-01", "00"): 1}
    for (topic, day, hour), n in sizes.items():
        folder = root / topic / f"date={day}" / f"hour={hour}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "part-00000-0-1.avro").write_bytes(b"x" * n)
        (folder / ".part-00001-0-1.avro.tmp").write_bytes(b"x" * 5000)  # in-flight files are not input
    kafka = KafkaSettings()
    common = dict(source="archive", archive_dir=root, out=tmp_path / "out")
    assert input_bytes(FinetuneSettings(**common), kafka) == 1110
    assert input_bytes(FinetuneSettings(**common, until="2026-01-02T00:00:00"), kafka) == 110
    assert input_bytes(UsageReportSettings(**common), kafka) == 1101
    assert input_bytes(FinetuneSettings(source="kafka", out=tmp_path / "out"), kafka) is None
