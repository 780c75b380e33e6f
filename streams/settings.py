"""The streams worker's one settings object (env ``CHATPIPE_STREAMS_*``).

Memory (Qdrant, embedding model) has its own ``MemorySettings`` (``CHATPIPE_MEMORY_*``) and the
broker its ``KafkaSettings``; the CLI builds all three and passes them in.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.requests import DEFAULT_CONTEXT_TOKENS, MIN_CONTEXT_TOKENS
from transport.context_settings import SHARED_CONTEXT_ENV, with_shared_context


class StreamsSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CHATPIPE_STREAMS_", frozen=True, extra="forbid")

    app_id: str = Field("chatpipe-streams", description="Faust app id: consumer group and changelog topic names "
                                                         "(the topic prefix goes in front)")
    state_dir: Path = Field(Path(".chatpipe/streams"), description="Faust's data folder")
    archive_dir: Path = Field(Path(".chatpipe/archive"), description="Root of the Avro archive spark_jobs reads")
    tokenizer_path: Path | None = Field(
        None, description="Folder of the chat model's tokenizer; empty = the default model (the CLI finds it)")
    system_prompt: str = Field("You are a helpful assistant.",
                               description="System prompt when the request brings none")
    # Batching of intake (adaptive, streams/faust_runtime/take.py): a batch closes at `intake_batch_size`
    # prompts, when no further prompt came within `intake_batch_idle_s`, `intake_batch_window_s` after its
    # first prompt at the latest, or (split after take) when its prompts' tokens pass `intake_batch_tokens`.
    intake_batch_size: int = Field(32, ge=1, description="Most prompts per intake batch")
    intake_batch_window_s: float = Field(0.05, gt=0, description="Longest a batch stays open while prompts "
                                                                 "keep arriving")
    intake_batch_idle_s: float = Field(0.002, ge=0, description="A batch closes when no further prompt came "
                                                                "within this long (0: when none was waiting)")
    intake_batch_tokens: int = Field(8192, ge=1, description="Most prompt tokens per intake batch")
    record_batch_size: int = Field(64, ge=1, description="Most responses per record batch")
    record_batch_window_s: float = Field(0.05, gt=0, description="Longest a record batch stays open while "
                                         "responses keep arriving")
    record_batch_idle_s: float = Field(0.002, ge=0, description="A record batch closes when no further response "
                                       "came within this long (a follow-up may be waiting for it)")
    recorded_wait_s: float = Field(5.0, ge=0, description="Longest intake waits for the record agent to record "
                                   "a conversation's answered requests before assembling its next prompt")
    archive_batch_size: int = Field(2000, ge=1, description="Most messages per archive write")
    archive_flush_s: float = Field(2.0, gt=0, description="Longest a message waits before it is archived")
    # Context
    context_tokens: int = Field(DEFAULT_CONTEXT_TOKENS, json_schema_extra=SHARED_CONTEXT_ENV, ge=MIN_CONTEXT_TOKENS,
                                description="The model's context window (prompt + answer): CHATPIPE_CONTEXT_TOKENS, "
                                            "shared with the engine (schemas/requests.py); "
                                            "CHATPIPE_STREAMS_CONTEXT_TOKENS is its deprecated alias")
    recent_turns: int = Field(8, ge=0, description="Turns kept in the conversation table and always offered "
                                                   "to the context; recall skips them")
    pending_limit: int = Field(64, ge=1, description="Most requests per conversation awaiting a response")
    dedupe_window: int = Field(256, ge=1, description="Request ids remembered per conversation to drop "
                                                      "a response delivered twice")
    conversation_idle_s: float = Field(30 * 24 * 3600, gt=0, description="A conversation with no prompt for this "
                                       "long leaves the table (its recent window and counters; memory keeps its "
                                       "turns): the table stays bounded. Default 30 days")
    idle_sweep_s: float = Field(3600, gt=0, description="How often each worker sweeps its table for idle "
                                                        "conversations")
    torch_threads: int | None = Field(None, ge=1, description="torch CPU threads for the embedding model; empty = "
                                                            "torch's default (all cores). 1 keeps a busy shared "
                                                            "machine from stalling on thread barriers")
    commit_interval_s: float = Field(1.0, gt=0, description="How often Faust commits consumed offsets")
    fetch_max_wait_ms: int = Field(100, ge=1, le=1500, description="Longest the broker holds a fetch of Faust's "
                                   "consumer with nothing to return: a record on a partition the fetch in flight "
                                   "left out waits up to this long (streams/faust_runtime/fetch_wait.py; Faust's "
                                   "own is 1500)")
    # 0 by default: with the in-memory store a standby does not shorten a takeover (Faust restores an
    # assigned partition from the changelog's start whatever a standby held, MemoryStore.persisted_offset
    # is None) and costs a second read of the changelog; it pays with a persistent store (RocksDB).
    standby_replicas: int = Field(0, ge=0, description="Standby copies of each conversation-table partition "
                                  "kept by other streams workers (Faust's table_standby_replicas)")
    session_timeout_s: float = Field(
        10.0, ge=6, le=300, description="Consumer group session timeout: how soon a worker that died (SIGKILL, "
                                        "an exit past the retry budget) is dropped from the group, so its "
                                        "restart gets the partitions back (broker minimum 6 s)")
    # Faults of the infrastructure (Qdrant, broker, disk): retried with backoff for the budget, then the
    # process exits without acking the batch in hand (streams/faults.py).
    stall_s: float = Field(30.0, gt=0, description="How long records may wait on an assigned source partition "
                           "with nothing reaching its agent, or a table restore may receive nothing, before the "
                           "process exits to be restarted (streams/faust_runtime/watchdog.py)")
    stall_check_s: float = Field(5.0, gt=0, description="How often the consumer's progress is checked")
    recall_timeout_s: float = Field(2.0, gt=0, description="Longest intake waits for memory's recall (tries "
                                    "included); past it the prompts are served with their recent turns only, "
                                    "marked memory_degraded: memory is an enhancement, never a reason to wait")
    worker_stale_s: float = Field(30.0, gt=0, description="A worker whose last report (chat.workers.status) is "
                                  "older than this is not counted when intake estimates whether a prompt's "
                                  "deadline can be met (as the gateway's setting of that name)")
    retry_budget_s: float = Field(60.0, gt=0, description="How long the agents retry the broker, and forget "
                                                          "and the memory writer Qdrant, before the process exits unacked")
    retry_backoff_s: float = Field(0.5, gt=0, description="First wait between retries; doubles per retry")
    retry_max_backoff_s: float = Field(5.0, gt=0, description="Longest wait between retries")
    archive_retry_budget_s: float = Field(
        300.0, gt=0, description="How long the archive retries a failed write (disk full, folder unwritable) "
                                 "before the process exits unacked; longer than retry_budget_s because a "
                                 "stalled archive holds up only itself, while an exit stops every agent")
    archive_dedupe_window: int = Field(10_000, ge=1, description="Event ids per partition the archive "
                                                                 "remembers to drop a repeated record")
    reply_topics_cache_s: float = Field(30.0, gt=0, description="How long intake trusts its list of topics "
                                                                "when checking reply addresses")
    web_port: int | None = Field(None, ge=1, le=65535, description="Faust's web server port; empty = off")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics port (streams/metrics.py); 0 = off")
    metrics_host: str = Field("127.0.0.1", description="Address /metrics listens on: loopback by default; 0.0.0.0 "
                              "in a Kubernetes pod, where the kubelet's probes and Prometheus reach the pod's IP")
    version_stats_interval_s: float = Field(10.0, gt=0, description="How often the version agent publishes the "
                                            "per-version stats (chat.models.stats, /metrics) and applies the "
                                            "canaries' rollout rules (streams/version_agent.py)")
    lag_interval_s: float = Field(5.0, gt=0, description="How often the consumer group's lag is measured for "
                                  "/metrics (records and seconds, transport/lag.py)")
    log_level: str = Field("info", description="Worker log level")

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        # context_tokens is the one context size of streams and the engine, not a setting of its own
        return with_shared_context("context_tokens", init_settings, env_settings, dotenv_settings,
                                   file_secret_settings, settings_cls)
