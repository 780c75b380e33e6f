"""Spark fixtures: one local[2] session for the folder, the planted log run through the job once, the
standalone cluster. Package-scoped: the folder runs on one xdist worker (tests/conftest.py), and the JVMs
stop when its last test is done instead of idling through the rest of the run."""

from __future__ import annotations

import pytest

from chatpipe.testing.synthetic_log import generate, to_messages
from tests.training.conftest import BATCH_NICE
from spark_jobs.settings import FinetuneSettings, SparkSettings
from transport.archive import write_messages


@pytest.fixture(scope="package")
def spark():
    from spark_jobs.session import build_session

    session = build_session(SparkSettings(master="local[2]", shuffle_partitions=2, progress=False,
                                          conf={"spark.sql.adaptive.coalescePartitions.enabled": "true"}))
    yield session
    session.stop()


@pytest.fixture(scope="package")
def planted_log():
    return generate(n_turns=600, seed=11)


@pytest.fixture(scope="package")
def planted_run(spark, planted_log, tmp_path_factory):
    """The finetune job over the planted log, read from the archive: (settings, result)."""
    from spark_jobs.finetune_dataset import run
    from transport.settings import KafkaSettings

    root = tmp_path_factory.mktemp("planted")
    write_messages(root / "archive", to_messages(planted_log, "chat.turns", "chat.feedback"))
    eval_file = root / "eval.txt"
    eval_file.write_text("\n".join(planted_log.eval_lines))
    settings = FinetuneSettings(source="archive", archive_dir=root / "archive", out=root / "out",
                                eval_files=(eval_file,), validation_fraction=0.2)
    return settings, run(spark, settings, KafkaSettings())


@pytest.fixture(scope="package")
def spark_cluster(tmp_path_factory):
    """A Spark standalone cluster (master + 2 workers, 1 core / 1g each) on free loopback ports, started
    and stopped with `chatpipe spark up|down` in a temporary state folder: yields the ``SparkCluster``."""
    import os
    import subprocess
    import sys

    from infra.services import alive
    from infra.spark_cluster import SparkCluster
    from infra.spark_cluster_settings import SparkClusterSettings

    state = tmp_path_factory.mktemp("spark-cluster")
    cli = [sys.executable, "-m", "chatpipe.cli", "spark"]
    # At the batch priority, which the daemons, their executors and the training processes those start inherit:
    # the jobs and training runs on the cluster are batch work beside the stack tests (tests/training/conftest.py).
    subprocess.run(cli + ["up", "--state-dir", str(state), "--workers", "2", "--worker-cores", "1",
                          "--worker-memory", "1g"], check=True, capture_output=True, timeout=300,
                   preexec_fn=lambda: os.nice(BATCH_NICE))
    cluster = SparkCluster(SparkClusterSettings(state_dir=state))
    pids = [cluster.status().master_pid] + [w.pid for w in cluster.status().workers]
    yield cluster
    down = subprocess.run(cli + ["down", "--state-dir", str(state)], capture_output=True, text=True, timeout=120)
    assert "stopped: master, worker-1, worker-2" in down.stdout, "a Spark daemon had died before the end of the session"
    assert not any(alive(pid) for pid in pids)  # a zombie not yet reaped by init counts as gone
    assert (state / "spark" / "master" / "master.log").stat().st_size > 0, "down must keep the logs"
