"""What a new user gets from ``chatpipe job ...`` when something is wrong: one line, in seconds,
decided before Spark starts (no JVM warnings, no Py4J traceback), and nothing of theirs deleted.

The error cases run the installed ``chatpipe`` command in a subprocess (its real exit code and
output); the empty-archive case runs the real command in-process (typer's CliRunner) so that it
shares the test session's SparkSession instead of starting a second JVM.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chatpipe.testing.ports import free_port as _free_port
from spark_jobs.errors import OutputExistsError
from spark_jobs.preflight import JOB_MARKER, check_output

pytestmark = pytest.mark.spark

CHATPIPE = str(Path(sys.executable).with_name("chatpipe"))


def _chatpipe(*args: str) -> tuple[int, str, float]:
    started = time.monotonic()
    # A wide console: rich would otherwise break the line at 80 columns (no terminal here).
    env = {**os.environ, "COLUMNS": "500"}
    proc = subprocess.run([CHATPIPE, "job", *args, "--quiet"], capture_output=True, text=True, timeout=120, env=env)
    return proc.returncode, (proc.stdout + proc.stderr).strip(), time.monotonic() - started


def _assert_one_line_error(output: str, *must_name: str) -> None:
    lines = output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), output[-2000:]
    for text in must_name:
        assert text in lines[0], (text, lines[0])
    assert "Traceback" not in output and "WARN" not in output


def test_kafka_source_without_a_broker_fails_within_seconds_naming_the_servers(tmp_path):
    """Catches the job starting Spark against a broker that is not there (minutes of retries, a
    screen of Java warnings, a Py4J traceback) instead of saying which servers it could not reach."""
    servers = f"127.0.0.1:{_free_port()}"
    rc, out, seconds = _chatpipe("finetune-dataset", "--out", str(tmp_path / "ft"), "--source", "kafka",
                                 "--bootstrap-servers", servers)
    assert rc == 1
    _assert_one_line_error(out, servers)
    assert seconds < 30
    assert not (tmp_path / "ft").exists()


@pytest.mark.parametrize("what", ["archive folder", "eval file"])
def test_missing_input_is_one_line_before_spark_starts(tmp_path, what):
    """Catches a missing --archive-dir or --eval-file reported only after Spark started (seconds of
    JVM start and warnings first), or with a traceback instead of the path."""
    archive = tmp_path / "archive"
    args = ["finetune-dataset", "--out", str(tmp_path / "ft"), "--source", "archive", "--archive-dir", str(archive)]
    if what == "eval file":
        archive.mkdir()
        missing = tmp_path / "evals" / "mmlu.jsonl"
        args += ["--eval-file", str(missing)]
    else:
        missing = archive
    rc, out, seconds = _chatpipe(*args)
    assert rc == 1
    _assert_one_line_error(out, what, str(missing))
    assert seconds < 30


@pytest.mark.parametrize("job", ["finetune-dataset", "usage-report"])
def test_overwrite_refuses_a_folder_that_is_not_this_jobs_output(tmp_path, job):
    """Catches --overwrite deleting a user's folder (or another job's output) without a word."""
    mine = tmp_path / "thesis"
    mine.mkdir()
    (mine / "chapter1.tex").write_text("years of work")
    rc, out, seconds = _chatpipe(job, "--out", str(mine), "--overwrite", "--source", "archive",
                                 "--archive-dir", str(tmp_path))
    assert rc == 1
    _assert_one_line_error(out, "refusing to replace", str(mine))
    assert (mine / "chapter1.tex").read_text() == "years of work"

    other = tmp_path / "other-job"
    other.mkdir()
    (other / JOB_MARKER).write_text("usage-report\n" if job == "finetune-dataset" else "finetune-dataset\n")
    with pytest.raises(OutputExistsError, match="holds an output of"):
        check_output(other, True, job)
    (other / JOB_MARKER).write_text(job + "\n")
    check_output(other, True, job)  # a previous output of the same job: may be replaced
    with pytest.raises(OutputExistsError, match="--overwrite"):
        check_output(other, False, job)


def test_empty_archive_warns_and_the_report_links_no_missing_chart(spark, tmp_path):
    """Catches an empty time range passing silently (no warning) and a usage report whose Markdown
    links charts it did not write; the run itself must still succeed and mark its output."""
    from typer.testing import CliRunner

    from chatpipe.cli import app
    from spark_jobs.preflight import check_inputs
    from spark_jobs.settings import FinetuneSettings
    from transport.settings import KafkaSettings

    archive = tmp_path / "archive"
    (archive / "chat.turns").mkdir(parents=True)
    out = tmp_path / "report"
    result = CliRunner().invoke(app, [
        "job", "usage-report", "--out", str(out), "--source", "archive", "--archive-dir", str(archive),
        "--master", "local[2]", "--shuffle-partitions", "2", "--quiet",
        "--conf", "spark.sql.adaptive.coalescePartitions.enabled=true"])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.output.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "no chat.turns messages" in warnings[0] and str(archive) in warnings[0]
    report = (out / "usage_report.md").read_text()
    assert ".png" not in report and "No data" in report
    assert not list(out.glob("*.png"))
    assert (out / JOB_MARKER).read_text().strip() == "usage-report"
    check_output(out, True, "usage-report")  # a rerun with --overwrite may replace it

    # The finetune job decides the same before Spark starts (same check, no run needed here).
    s = FinetuneSettings(source="archive", archive_dir=archive, out=tmp_path / "ft", since="2026-01-01",
                         until="2026-01-02")
    assert [w.startswith("warning: no chat.turns messages") for w in check_inputs(s, KafkaSettings())] == [True]
