"""The driver JVM's class-data-sharing archive (spark_jobs/jvm_archive.py).

Java 17 aborts on a truncated archive instead of ignoring it, so the rule that matters is: an
archive reaches its final name only after a JVM has started with it. These tests use the real
``java`` (no Spark session): the first call asks the JVM to write the archive at exit, a JVM run
with those options writes it, and only a complete one is promoted.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from spark_jobs import jvm_archive


def _dead_pid() -> int:
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


def _as_dead_writer(options: str) -> str:
    """The options as a job that has since exited would have got them (its pid is in the name)."""
    return options.replace(f".{os.getpid()}.tmp", f".{_dead_pid()}.tmp")


@pytest.fixture()
def java():
    java = jvm_archive._java()
    if java is None:
        pytest.fail("no java found: the Spark jobs need Java 17 (README setup)")
    return java


def _run_java(java: str, options: str, cwd) -> None:
    """A JVM that loads classes and exits normally (``-version`` alone writes no archive)."""
    (cwd / "Hello.java").write_text("class Hello { public static void main(String[] a) { System.out.println(1); } }")
    subprocess.run([java, *options.split(), "Hello.java"], cwd=cwd, check=True, capture_output=True, timeout=120)


def test_first_run_writes_then_a_later_run_maps_the_archive(java, tmp_path):
    first = jvm_archive.driver_java_options(tmp_path)
    assert "-XX:ArchiveClassesAtExit=" in first
    _run_java(java, _as_dead_writer(first), tmp_path)  # a dead pid's dump
    second = jvm_archive.driver_java_options(tmp_path)
    archives = list((tmp_path / "cds").glob("driver-*.jsa"))
    assert len(archives) == 1 and f"-XX:SharedArchiveFile={archives[0]}" in second
    assert list((tmp_path / "cds").glob("*.tmp")) == []
    _run_java(java, second, tmp_path)  # the promoted archive starts a JVM


def test_a_truncated_archive_is_never_promoted(java, tmp_path):
    first = jvm_archive.driver_java_options(tmp_path)
    dump = _as_dead_writer(first).split("-XX:ArchiveClassesAtExit=")[1].split()[0]
    _run_java(java, f"-XX:ArchiveClassesAtExit={dump}", tmp_path)
    data = open(dump, "rb").read()
    open(dump, "wb").write(data[: len(data) // 3])  # a JVM killed while writing it
    options = jvm_archive.driver_java_options(tmp_path)
    assert "SharedArchiveFile" not in options and "ArchiveClassesAtExit" in options  # writes a new one instead
    assert list((tmp_path / "cds").glob("driver-*.jsa")) == []
    assert not (tmp_path / "cds" / dump.rsplit("/", 1)[1]).exists()
