"""Raw Kafka messages of one topic and time range, from the broker or from the archive.

Both readers return the same columns, those of Spark's Kafka source::

    topic string, partition int, offset long, timestamp long (epoch ms), key binary, value binary

so decoding and everything after it cannot tell the sources apart. The time range is on the
Kafka record timestamp, ``since`` inclusive and ``until`` exclusive, in both readers.

Kafka: a bounded batch read (``spark.read.format("kafka")``), starting at the first offset
whose timestamp is >= ``since`` (``startingTimestamp``) and ending at the first offset >=
``until`` (``endingTimestamp``) in every partition, or earliest/latest when not given; rows are
also filtered on the timestamp, since timestamps are only roughly ordered within a partition.
Archive: the hour folders that overlap the range (partition pruning on ``date=``/``hour=``).
"""

from __future__ import annotations

from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import BinaryType, IntegerType, LongType, StringType, StructField, StructType

from spark_jobs.errors import InputError

RAW_SCHEMA = StructType([
    StructField("topic", StringType()),
    StructField("partition", IntegerType()),
    StructField("offset", LongType()),
    StructField("timestamp", LongType()),
    StructField("key", BinaryType()),
    StructField("value", BinaryType()),
])


def _in_range(df: DataFrame, since: int | None, until: int | None) -> DataFrame:
    if since is not None:
        df = df.where(F.col("timestamp") >= since)
    if until is not None:
        df = df.where(F.col("timestamp") < until)
    return df


def read_kafka(spark: SparkSession, connection: dict[str, str], topic: str,
               since: int | None = None, until: int | None = None) -> DataFrame:
    """Messages of ``topic`` with since <= timestamp < until, as one bounded batch.

    ``connection``: ``KafkaSettings.spark_kafka_options()``, the servers and the Java client's
    security options; it may hold the SASL password (JAAS line) and a private key: never log it.
    """
    reader = (spark.read.format("kafka").options(**connection).option("subscribe", topic)
              .option("failOnDataLoss", "false"))  # retention may have deleted the oldest offsets
    if since is not None:
        reader = reader.option("startingTimestamp", str(since)).option(
            "startingOffsetsByTimestampStrategy", "latest")
    else:
        reader = reader.option("startingOffsets", "earliest")
    if until is not None:
        reader = reader.option("endingTimestamp", str(until))
    else:
        reader = reader.option("endingOffsets", "latest")
    df = reader.load().select(
        "topic", "partition", "offset",
        F.unix_millis(F.col("timestamp")).alias("timestamp"), "key", "value",
    )
    return _in_range(df, since, until)


def read_archive(spark: SparkSession, root: Path, topic: str,
                 since: int | None = None, until: int | None = None) -> DataFrame:
    """Messages of ``topic`` archived under ``root`` with since <= timestamp < until."""
    root = Path(root)
    if not root.is_dir():
        raise InputError(f"archive folder {root} does not exist")
    folder = root / topic
    if not any(folder.glob("date=*/hour=*/*.avro")):
        return spark.createDataFrame([], RAW_SCHEMA)
    df = spark.read.format("avro").option("basePath", str(folder)).load(str(folder))
    # Prune hour folders first (cheap: folder names), then filter exactly on the timestamp.
    if since is not None:
        df = df.where(F.col("date") >= F.to_date(F.timestamp_millis(F.lit(since))))
    if until is not None:
        df = df.where(F.col("date") <= F.to_date(F.timestamp_millis(F.lit(until))))
    df = df.select(*[F.col(f.name).cast(f.dataType) for f in RAW_SCHEMA.fields])
    return _in_range(df, since, until)
