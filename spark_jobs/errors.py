"""Named errors of the batch jobs: each says what to do about it."""

from __future__ import annotations

from schemas.errors import ChatpipeError


class SparkJobError(ChatpipeError):
    """Root of the errors the Spark jobs raise on purpose."""


class JarsUnavailableError(SparkJobError):
    """The Spark connector jars (Kafka source, spark-avro) could not be fetched from Maven Central."""


class OutputExistsError(SparkJobError):
    """The output folder exists and overwriting was not asked for."""


class InputError(SparkJobError):
    """The job's input (archive folder, eval file, time range) cannot be used."""


class OptionError(SparkJobError):
    """A job option (flag or CHATPIPE_* variable) has a value its settings field cannot take."""
