"""Batch jobs over the logged conversation turns and feedback (pyspark).

- ``finetune_dataset``: turns + feedback -> redacted, filtered, deduplicated, decontaminated
  SFT examples and preference pairs (chat JSONL + Parquet + dataset card).
- ``usage_report``: per day and model usage, latency and error figures (Parquet + Markdown + PNG).
- ``erasure`` (no pyspark needed to call ``affected_datasets``): subject and conversation keys the
  datasets carry, and which datasets hold an erased user's rows; ``deletions``: the Deletions
  the dataset job applies.

Inputs come from Kafka (bounded batch read) or from the Avro archive (``transport/archive.py``
defines its layout). pyspark is imported only by the modules that build DataFrames;
``settings`` and the ``pii``/``filters`` pure-Python halves import without it. Test data
(``chatpipe/testing/synthetic_log.py``) and the benchmark baseline (``bench/finetune_reference.py``)
live outside this package: they are not part of what a user installs.
"""
