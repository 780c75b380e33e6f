"""The spark-submit forms of docs/spark_jobs.md: `chatpipe spark submit --print` builds a complete
command, and a bare `spark-submit spark_jobs/<job>.py` without the connector jars stops at once
with one line naming them (it used to end in AVRO_NOT_LOADED_SQL_FUNCTIONS_UNUSABLE).

The run of `chatpipe spark submit` on the cluster is in test_cluster.py.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from chatpipe.testing.synthetic_log import generate, to_messages
from transport.archive import write_messages

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.spark


def _connector_jars() -> list[Path]:
    from spark_jobs.jars import connector_jars
    from spark_jobs.settings import SparkSettings

    return connector_jars(SparkSettings().jars_cache_dir)


def test_print_shows_a_complete_spark_submit_command(tmp_path):
    """Catches a printed command that lacks the connector jars, the executors' Python, the venv's
    Spark (SPARK_HOME) or the job's own flags, or that defaults to a master it should not."""
    from infra.spark_cluster import spark_home

    proc = subprocess.run([sys.executable, "-m", "chatpipe.cli", "spark", "submit", "finetune-dataset", "--print",
                           "--state-dir", str(tmp_path / "no-cluster"), "--",
                           "--out", str(tmp_path / "ft"), "--source", "archive", "--archive-dir", "/data/x y"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    words = shlex.split(proc.stdout.strip())
    assert words[0] == f"SPARK_HOME={spark_home()}"
    assert words[1] == str(spark_home() / "bin" / "spark-submit") and Path(words[1]).is_file()
    assert words[words.index("--master") + 1] == "local[*]"  # no cluster runs in that state folder
    jars = words[words.index("--jars") + 1].split(",")
    assert jars[:5] == [str(j) for j in _connector_jars()]
    assert len(jars) == 6 and Path(jars[5]).name.startswith("chatpipe-functions-") and Path(jars[5]).is_file()
    assert f"spark.pyspark.python={sys.executable}" in words
    assert words[-7:] == [str(REPO / "spark_jobs" / "finetune_dataset.py"), "--out", str(tmp_path / "ft"),
                          "--source", "archive", "--archive-dir", "/data/x y"]


def test_bare_spark_submit_names_the_jars_to_add(tmp_path):
    """Catches the documented bare form failing deep inside Spark (a Py4J traceback ending in
    AVRO_NOT_LOADED_SQL_FUNCTIONS_UNUSABLE) instead of one line naming the --jars to add."""
    from infra.spark_cluster import spark_home

    log = generate(n_turns=20, seed=3, planted=False)
    write_messages(tmp_path / "archive", to_messages(log, "chat.turns", "chat.feedback"))
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "PYSPARK_PYTHON": sys.executable,
           "SPARK_HOME": str(spark_home())}
    proc = subprocess.run([str(spark_home() / "bin" / "spark-submit"), "spark_jobs/usage_report.py",
                           "--out", str(tmp_path / "report"), "--source", "archive",
                           "--archive-dir", str(tmp_path / "archive")],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr  # spark-submit passes the Python driver's stderr on as its stdout
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output[-3000:]
    assert f"--jars {','.join(str(j) for j in _connector_jars())}" in errors[0]
    assert "chatpipe spark submit usage-report" in errors[0]
    assert "Traceback" not in output and "AVRO_NOT_LOADED" not in output
    assert not (tmp_path / "report").exists()
