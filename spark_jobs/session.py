"""A SparkSession from ``SparkSettings``: master, conf pass-through, connector jars.

Defaults suit one machine (``local[*]``, few shuffle partitions, no UI); any ``spark.*``
setting given in ``SparkSettings.conf`` wins over them, so the same job runs on a cluster with
``--master`` and ``--conf``. Under ``spark-submit`` a session that already exists is reused and
only the jars are checked.
"""

from __future__ import annotations

import logging

from spark_jobs.jars import connector_jars
from spark_jobs.settings import SparkSettings

log = logging.getLogger(__name__)


def session_conf(settings: SparkSettings) -> dict[str, str]:
    """The Spark conf this project sets, overridden by ``settings.conf``."""
    jars = ",".join(str(p) for p in connector_jars(settings.jars_cache_dir))
    conf = {
        "spark.app.name": settings.app_name,
        "spark.sql.shuffle.partitions": str(settings.shuffle_partitions),
        "spark.sql.session.timeZone": "UTC",  # hour folders and report days are UTC
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",  # rich shows progress per step instead
        "spark.driver.memory": "4g",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.sql.adaptive.enabled": "true",
    }
    conf.update(settings.conf)
    extra = conf.get("spark.jars")
    conf["spark.jars"] = f"{jars},{extra}" if extra and extra != jars else jars
    return conf


def build_session(settings: SparkSettings):
    """Get or create the SparkSession for a job."""
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master(settings.master)
    for key, value in session_conf(settings).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    log.info("spark %s on %s", spark.version, spark.sparkContext.master)
    return spark
