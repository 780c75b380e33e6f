"""The model registry's contract: how a ``ModelVersion`` is keyed on ``chat.models`` and what its
artifact folder holds (written by ``training.publish``, read by ``chatpipe model`` and by the streams
tier when an erasure taints a version). Names only; no I/O.

An artifact folder (``<store>/<name>/<version>/``, a path or any fsspec URI)::

    adapter/            the LoRA adapter (peft: adapter_config.json, adapter_model.safetensors)
    card.md, card.json  the training card
    loss.png            the loss curve
    lineage.parquet     one row per training example: LINEAGE_COLUMNS
"""

from __future__ import annotations

ADAPTER_DIR = "adapter"
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # what ModelVersion.adapter_sha256 is the hash of
CARD_MD = "card.md"
CARD_JSON = "card.json"
LOSS_PNG = "loss.png"
LINEAGE_FILE = "lineage.parquet"
#: Columns of lineage.parquet, one row per example of the training split the version learned from:
#: ``line`` (its line in sft/train.jsonl), ``tenant``, ``subject`` and ``conversation_key`` (the dataset
#: job's hashes, spark_jobs/erasure.py), ``oldest_at`` (epoch ms of the oldest record it holds), and the
#: ``request_ids`` / ``trace_ids`` of every turn it holds, in turn order.
LINEAGE_COLUMNS = ("line", "tenant", "subject", "conversation_key", "oldest_at", "request_ids", "trace_ids")


def model_key(name: str, version: int) -> str:
    """The Kafka key of a version on ``chat.models``: every version keeps its own latest record (a key of
    the name alone would compact away all but the newest version, and several are served at once)."""
    return f"{name}@{version}"


def parse_model_ref(ref: str) -> tuple[str, int | None]:
    """``name@version`` -> (name, version); ``name`` alone -> (name, None): its newest version."""
    name, _, version = ref.partition("@")
    if not name or (version and not version.isdigit()):
        raise ValueError(f"{ref!r} is not a model version: name@version (e.g. acme-support@3) or a name")
    return name, int(version) if version else None
