"""What a job checks before Spark starts: inputs that exist, a reachable broker, an output folder
it may replace. Each problem is one line (a named error, or a warning string), in seconds,
instead of a Spark start, a screen of JVM warnings and a Py4J traceback later.

- ``--source kafka``: a TCP connection to a bootstrap server (``TopicAdmin.check_reachable``);
  without one, Spark's Kafka source would retry for minutes. Then the broker must take the
  ``CHATPIPE_KAFKA_*`` credentials and its certificate must be trusted (``transport.connect_check``),
  or the job ends with that one line instead of a JVM stack trace.
- ``--source archive``: the archive folder exists; no archived file of the turns topic in the
  time range is a *warning*, not an error (a scheduled run over a quiet hour is not a failure):
  the job still writes its outputs, empty, and says so.
- ``--eval-file``: each file exists.
- The output folder: ``--overwrite`` replaces only a folder holding a previous output of the
  same job, recognised by the ``_chatpipe_job`` file every job writes into its output (the job's
  name); anything else (a user's folder, another job's output, a file) is refused. An existing
  empty folder is fine with ``--overwrite``.

Not here: running the job; the jobs call :func:`check_inputs` and :func:`job_output` themselves
too, so a library caller gets the same checks.
"""

from __future__ import annotations

from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path

from spark_jobs.errors import InputError, OutputExistsError

#: The file naming the job that wrote an output folder (readers skip names starting with ``_``).
JOB_MARKER = "_chatpipe_job"


def _iso(ms: int | None) -> str:
    return "-" if ms is None else datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat(timespec="seconds")


def archived_files(root: Path, topic: str, since: int | None, until: int | None) -> list[Path]:
    """Archive files of ``topic`` in hour folders that overlap [since, until) (by folder name only)."""
    files = []
    for path in (Path(root) / topic).glob("date=*/hour=*/*.avro"):
        if path.name.startswith((".", "_")):
            continue
        try:
            start = datetime.strptime(f"{path.parent.parent.name[5:]} {path.parent.name[5:]}", "%Y-%m-%d %H")
        except ValueError:
            continue
        start_ms = int(start.replace(tzinfo=timezone.utc).timestamp() * 1000)
        end_ms = start_ms + int(timedelta(hours=1).total_seconds() * 1000)
        if (until is None or start_ms < until) and (since is None or end_ms > since):
            files.append(path)
    return files


def input_bytes(s, kafka) -> int | None:
    """Bytes of archive files the job will read (every ``*_topic`` of its settings, in its time
    range); None for a Kafka source (unknown before reading)."""
    if s.source != "archive" or not Path(s.archive_dir).is_dir():
        return None
    topics = [getattr(s, name) for name in type(s).model_fields if name.endswith("_topic")]
    return sum(f.stat().st_size for t in topics for f in archived_files(s.archive_dir, kafka.topic(t), s.since, s.until))


def no_data_warning(s, kafka) -> str:
    """The one-line warning for a run that found no turns in its range."""
    where = f"archive {s.archive_dir}" if s.source == "archive" else f"Kafka at {kafka.bootstrap_servers}"
    return (f"warning: no {kafka.topic(s.turns_topic)} messages in {where} between {_iso(s.since)} and "
            f"{_iso(s.until)}: the outputs are written, empty")


def check_inputs(s, kafka, reach_timeout_s: float = 3.0) -> list[str]:
    """Raise on inputs the job cannot use (one-line named errors); return warnings (lines).

    ``s``: FinetuneSettings or UsageReportSettings; ``kafka``: the transport's KafkaSettings.
    """
    warnings = []
    if s.source == "kafka":
        from transport.admin import TopicAdmin
        from transport.connect_check import check_connection

        TopicAdmin(kafka).check_reachable(timeout_s=reach_timeout_s)  # TransportError naming the servers
        check_connection(kafka)  # KafkaConnectError: SASL credentials refused, broker certificate not trusted
    else:
        root = Path(s.archive_dir)
        if not root.is_dir():
            raise InputError(f"archive folder {root} does not exist (--archive-dir)")
        if not archived_files(root, kafka.topic(s.turns_topic), s.since, s.until):
            warnings.append(no_data_warning(s, kafka))
    for path in getattr(s, "eval_files", ()):
        if not Path(path).is_file():
            raise InputError(f"eval file {path} does not exist (--eval-file)")
    return warnings


def check_output(out: Path, overwrite: bool, job: str) -> None:
    """Raise :class:`OutputExistsError` unless ``out`` may be written by ``job``."""
    out = Path(out)
    if not out.exists() and not out.is_symlink():
        return
    if not overwrite:
        raise OutputExistsError(f"{out} exists; pass --overwrite to replace a previous output of {job}")
    if not out.is_dir() or out.is_symlink():
        raise OutputExistsError(f"{out} is not a folder; --overwrite only replaces a previous output of {job}")
    if not any(out.iterdir()):
        return
    marker = out / JOB_MARKER
    wrote = marker.read_text(encoding="utf-8").strip() if marker.is_file() else None
    if wrote != job:
        why = f"it holds an output of {wrote}" if wrote else f"it has no {JOB_MARKER} file"
        raise OutputExistsError(f"refusing to replace {out}: {why}, not a previous output of {job}; "
                                "choose another --out or remove it yourself")


@contextmanager
def job_output(out: Path, overwrite: bool, job: str):
    """``writers.atomic_output`` after :func:`check_output`; the temporary folder gets the job marker."""
    from spark_jobs.writers import atomic_output

    check_output(out, overwrite, job)
    with atomic_output(out) as tmp:
        (tmp / JOB_MARKER).write_text(job + "\n", encoding="utf-8")
        yield tmp
