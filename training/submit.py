"""``spark-submit training/submit.py``: a LoRA run in a Spark application's driver (the SparkApplication
``chatpipe k8s render`` writes): the processes are barrier tasks on the application's executors
(TorchDistributor, ``local_mode=False``), the SparkSession is the one spark-submit made.

Settings come from the environment only: ``CHATPIPE_TRAIN_*`` (the dataset, the base model's folder, the run
and artifact folders on volumes every executor mounts, the tenant scope) and the ``CHATPIPE_*`` Kafka
variables the registry needs. ``--master`` is ``session`` whatever the variable says. Exits 0 when the
version is published, 1 with one line otherwise.
"""

from __future__ import annotations

import sys

from schemas.errors import ChatpipeError


def main() -> int:
    from pyspark.sql import SparkSession

    from training.flow import finish, start
    from training.settings import TrainSettings
    from transport.settings import KafkaSettings

    settings = TrainSettings(master="session", progress=False)
    if settings.model_path is None:
        print("error: set CHATPIPE_TRAIN_MODEL_PATH to the base model's folder in the image or a volume", file=sys.stderr)
        return 1
    kafka = KafkaSettings()
    SparkSession.builder.appName("chatpipe-train").getOrCreate()
    say = lambda line: print(line, flush=True)
    try:
        run = start(settings, kafka, say)
        finish(settings, run, kafka, say)
    except ChatpipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
