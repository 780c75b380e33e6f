"""A class-data-sharing (CDS) archive for the driver JVM: Spark's classes mapped from a file.

Every job starts a fresh driver JVM that loads, parses and verifies some thousands of Spark
classes; at 5k turns that is a large share of the run. Java 17's dynamic CDS archives the
classes a JVM loaded (``-XX:ArchiveClassesAtExit``) and lets later JVMs map them
(``-XX:SharedArchiveFile``): measured on the quick bench, session start 3.5 s -> 1.9 s and the
job 16.6 s -> 14.8-15.2 s (docs/spark_jobs.md "Figures").

The first job writes the archive when its JVM exits, to a temporary name; a later job promotes
it to its final name only after a ``java -version`` with it exits cleanly, because Java 17
*crashes* on a truncated archive (a JVM killed while writing it) instead of ignoring it. An
archive of another JVM or Spark version is never picked (the name holds a hash of both), and
if the JVM finds one stale all the same (a jar changed in place) it ignores it: its CDS
warnings are switched off so none reaches the job's output.

Not for: spark-submit (the driver JVM exists before the job's code runs) or executors.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"


def _java() -> str | None:
    """The java that pyspark will start: ``$JAVA_HOME/bin/java``, else the first on PATH."""
    # JAVA_HOME is the JDK's variable, not a chatpipe setting: pyspark's launcher (spark-class) reads it from the
    # environment it hands the driver JVM, so the java found here is the one that JVM runs only when read the same way.
    home = os.environ.get("JAVA_HOME")
    java = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    return os.path.realpath(java) if java and os.path.exists(java) else None


def _archive_key(java: str) -> str:
    import pyspark

    ident = f"{java}|{os.path.getmtime(java)}|{pyspark.__version__}|{Path(pyspark.__file__).parent}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _loads_cleanly(java: str, archive: Path) -> bool:
    """Whether a JVM starts with ``archive`` (a truncated one aborts it; the crash log goes to a
    scratch folder, not the caller's working folder)."""
    with tempfile.TemporaryDirectory() as scratch:
        try:
            done = subprocess.run([java, f"-XX:SharedArchiveFile={archive}", *QUIET.split(), "-version"],
                                  cwd=scratch, capture_output=True, timeout=60)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            return False
    return done.returncode == 0


def driver_java_options(cache_dir: Path) -> str:
    """JVM options for the driver: map the archive if there is one, else write it at exit.

    Returns "" when no java is found or another job is writing the archive right now.
    """
    java = _java()
    if java is None:
        return ""
    folder = Path(cache_dir) / "cds"
    folder.mkdir(parents=True, exist_ok=True)
    key = _archive_key(java)
    final = folder / f"driver-{key}.jsa"
    if not final.exists():
        for tmp in sorted(folder.glob(f"driver-{key}.*.tmp")):
            pid = tmp.name.split(".")[1]
            if pid.isdigit() and _alive(int(pid)):
                return ""  # a running job writes it when its JVM exits
            if _loads_cleanly(java, tmp):
                os.replace(tmp, final)
                break
            tmp.unlink(missing_ok=True)
    if final.exists():
        for tmp in folder.glob(f"driver-{key}.*.tmp"):  # written by concurrent first runs, not needed
            pid = tmp.name.split(".")[1]
            if not (pid.isdigit() and _alive(int(pid))):
                tmp.unlink(missing_ok=True)
        return f"-XX:SharedArchiveFile={final} {QUIET}"
    return f"-XX:ArchiveClassesAtExit={folder / f'driver-{key}.{os.getpid()}.tmp'} {QUIET}"
