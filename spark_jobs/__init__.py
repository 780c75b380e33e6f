"""Batch jobs over the logged conversation turns and feedback (pyspark).

- ``finetune_dataset``: turns + feedback -> redacted, filtered, deduplicated, decontaminated
  SFT examples and preference pairs (chat JSONL + Parquet + dataset card).
- ``usage_report``: per day and model usage, latency and error figures (Parquet + Markdown + PNG).

Inputs come from Kafka (bounded batch read) or from the Avro archive (``transport/archive.py``
defines its layout). pyspark is imported only by the modules that build DataFrames;
``settings``, ``pii``/``filters`` pure-Python halves and ``synthetic`` import without it.
"""
