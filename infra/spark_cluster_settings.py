"""Settings of the Spark standalone cluster on one machine (``chatpipe spark up|down|status``).

One master and a few workers on loopback, run from the installed pyspark (its folder is
``SPARK_HOME``). Sized for a small machine: each worker offers ``spark_worker_cores`` cores and
``spark_worker_memory``, which a job's executor (Spark's default ``spark.executor.memory`` of 1g,
all of a worker's cores) fits. Ports are free ones picked at ``up`` unless given; what ``up``
picked is saved under ``<state>/spark`` so ``status`` and ``down`` find the cluster.

Not here: how a job reaches the cluster (``spark_jobs.shipping``), the Kafka cluster
(``infra.cluster_settings``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class SparkClusterSettings(BaseSettings):
    """A Spark standalone cluster (master + workers) on this machine.

    From CLI flags and ``CHATPIPE_*`` variables (``CHATPIPE_STATE_DIR``, ``CHATPIPE_SPARK_WORKERS``, ...).
    """

    model_config = SettingsConfigDict(env_prefix="CHATPIPE_", frozen=True, extra="ignore")

    state_dir: Path = Field(Path(".chatpipe"), description="The cluster's state, work folders and logs go under <state>/spark")
    host: str = Field("127.0.0.1", description="Address the master and workers listen on (loopback only by default)")
    spark_workers: int = Field(2, ge=1, le=8, description="Number of workers")
    spark_worker_cores: int = Field(1, ge=1, description="Cores each worker offers to executors")
    spark_worker_memory: str = Field("1g", pattern=r"^\d+[mg]$", description="Memory each worker offers to executors (e.g. 1g, 1536m)")
    spark_master_port: int = Field(0, ge=0, le=65535, description="Master RPC port (0: a free port, picked at up)")
    spark_webui_port: int = Field(0, ge=0, le=65535, description="Master web UI / JSON port (0: a free port, picked at up)")
    spark_daemon_heap: str = Field("256m", pattern=r"^\d+[mg]$", description="JVM heap of the master and of each worker daemon")
    spark_python: Path = Field(Path(sys.executable), description="Python the executors run (the project's venv)")
    spark_start_timeout_s: float = Field(120.0, gt=0, description="How long up waits for every worker to register")
    stop_timeout_s: float = Field(30.0, gt=0, description="How long down waits after SIGTERM before SIGKILL")

    @field_validator("state_dir")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        return value.expanduser().resolve()

    @property
    def spark_dir(self) -> Path:
        return self.state_dir / "spark"
