"""A SparkSession from ``SparkSettings``: master, conf pass-through, connector jars.

Defaults suit one machine (``local[*]``, few shuffle partitions, no UI); any ``spark.*``
setting given in ``SparkSettings.conf`` wins over them, so the same job runs on a cluster with
``--master`` and ``--conf``; on a cluster the project's code goes to the executors as a zip
(``shipping``). Under ``spark-submit`` its ``--master`` and ``--jars`` stand, and a run without
the connector jars stops with one line naming them.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from spark_jobs import jvm_functions
from spark_jobs.jars import connector_jars
from spark_jobs.jvm_archive import driver_java_options
from spark_jobs.settings import SparkSettings

log = logging.getLogger(__name__)


#: ``jit=auto`` picks the server JIT (C2) from this much archive input. Measured on 2 cores (bench/
#: finetune.py, JVM CPU seconds): C1 alone used 40% less at 5k turns (1.7 MB) and 20% less at 40k
#: (12 MB); at 200k turns (62 MB) the job ran 62 s with C1 alone, 56 s with C2.
SERVER_JIT_FROM_BYTES = 32 << 20


def client_jit(settings: SparkSettings, input_bytes: int | None) -> bool:
    """Whether the driver JVM runs with the client JIT only (``-XX:TieredStopAtLevel=1``)."""
    if settings.jit != "auto":
        return settings.jit == "client"
    return input_bytes is None or input_bytes < SERVER_JIT_FROM_BYTES


def session_conf(settings: SparkSettings, input_bytes: int | None = None) -> dict[str, str]:
    """The Spark conf this project sets, overridden by ``settings.conf``; ``input_bytes``: the size of
    the job's input when known (archive files), for ``jit=auto``."""
    jar_paths = connector_jars(settings.jars_cache_dir)
    functions = jvm_functions.functions_jar(settings.jars_cache_dir) if settings.jvm_functions else None
    jars = ",".join(str(p) for p in [*jar_paths, *([functions] if functions else [])])
    conf = {
        "spark.app.name": settings.app_name,
        "spark.sql.shuffle.partitions": str(settings.shuffle_partitions),
        "spark.sql.session.timeZone": "UTC",  # hour folders and report days are UTC
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",  # rich shows progress per step instead
        "spark.driver.memory": "4g",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.sql.adaptive.enabled": "true",
        # Small inputs: the driver JVM with the client JIT only (C1): the job's generated code is
        # large and short-lived, C2 spent more CPU compiling it than it saved (SERVER_JIT_FROM_BYTES).
        # Plus a class-data-sharing archive of Spark's classes (jvm_archive: faster start).
        "spark.driver.extraJavaOptions": " ".join(filter(None, [
            "-XX:TieredStopAtLevel=1" if client_jit(settings, input_bytes) else "",
            driver_java_options(settings.jars_cache_dir) if settings.class_data_sharing else "",
        ])),
    }
    if client_jit(settings, input_bytes):  # a cluster's executors too (in local mode they are the driver)
        conf["spark.executor.extraJavaOptions"] = "-XX:TieredStopAtLevel=1"
    conf.update(settings.conf)
    extra = conf.get("spark.jars")
    conf["spark.jars"] = f"{jars},{extra}" if extra and extra != jars else jars
    return conf


def build_session(settings: SparkSettings, input_bytes: int | None = None):
    """Get or create the SparkSession for a job (``input_bytes``: see :func:`session_conf`)."""
    from pyspark.sql import SparkSession

    from spark_jobs import shipping

    conf = session_conf(settings, input_bytes)
    # Registered only when the jar is on its way (it could not be built: that was said already).
    with_functions = settings.jvm_functions and jvm_functions.JAR_PREFIX in conf["spark.jars"]
    submitted = shipping.under_spark_submit()
    if submitted:
        # spark-submit started the driver's JVM: its --master and --jars stand (jars named now
        # could not reach the driver any more); a --master given to the job itself still wins.
        shipping.check_submitted([Path(j) for j in conf.pop("spark.jars").split(",") if j], sys.argv[0])
    builder = SparkSession.builder
    if not submitted or "master" in settings.model_fields_set:
        builder = builder.master(settings.master)
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    shipping.ship_project(spark, conf, settings.jars_cache_dir, submitted=submitted)
    if with_functions:
        jvm_functions.register(spark)  # a warning and the Spark SQL path when the JVM cannot load them
    spark.sparkContext.setLogLevel("WARN")
    log.info("spark %s on %s", spark.version, spark.sparkContext.master)
    return spark
