"""The inference worker's one settings object (env prefix ``CHATPIPE_WORKER_``).

Built once by ``chatpipe inference`` from flags and environment, frozen, passed in. The Kafka
connection (``KafkaSettings``) and the engine (``EngineSettings``) keep their own objects.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_worker_id() -> str:
    """<hostname>-<pid>"""
    return f"{socket.gethostname()}-{os.getpid()}"


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CHATPIPE_WORKER_", frozen=True, extra="forbid")

    worker_id: str = Field(default_factory=_default_worker_id, description="Name in Responses, chunks, heartbeats")
    engine: Literal["auto", "chatpipe", "vllm"] = Field(
        "auto", description="Which engine generates: chatpipe (ours: the default on CPU), vllm (vLLM's v1 engine, in "
        "its own environment: make setup-vllm), auto = vllm on a CUDA device when its environment is there, else "
        "chatpipe (docs/worker.md, Engines)")
    intake: Literal["partition", "share"] = Field(
        "partition", description="partition: consumer group (conversation affinity); share: share group (any free worker)")
    group_id: str = Field("chatpipe-inference", description="Consumer group of the workers (partition); share "
                          "groups are named <group_id>.share (a broker refuses a share group named like a consumer group)")
    max_in_flight: int = Field(0, ge=0, description="Requests taken at once (in the engine); 0 = partition: engine "
                               "max_batch + max_waiting (the backlog waits in the engine, where tenants get their "
                               "fair share), share: 2 x engine max_batch (a waiting record's lock runs out)")
    interactive_reserve: int = Field(0, ge=0,
                                     description="In-flight slots batch requests may not take; 0 = max_in_flight // 4 (>= 1)")
    max_delivery_attempts: int = Field(8, ge=1, le=8,
                                       description="share: REJECT (and dead-letter) after this many deliveries "
                                       "(at most 8: the broker's own limit, kept 2 above, caps at 10)")
    max_record_crashes: int = Field(3, ge=1, description="partition: a record whose own handling raised a bug (an "
                                    "exception the failure policy gives to neither the record nor an outage) this "
                                    "many times, each a crash of the worker, is dead-lettered the next time; share: "
                                    "max_delivery_attempts does it (the broker counts every delivery)")
    drill_crash_on: str = Field("", description="Fault drills only (tests/faults): a request whose last message is "
                                "exactly this text makes the worker raise RuntimeError while serving it, as a bug "
                                "would; empty = off")
    share_hold_s: float = Field(3.0, ge=0, description="share: how long over-delivered records wait here for a "
                                "free slot before they are RELEASEd to other workers")
    share_record_lock_ms: int = Field(
        60_000, ge=15_000, le=3_600_000,
        description="share: the group's record lock (share.record.lock.duration.ms); a generation still running "
        "shortly before it runs out is stopped (TIMEOUT). Above 60000 the broker's "
        "group.share.max.record.lock.duration.ms must be raised too")
    share_lock_margin_ms: int = Field(
        5_000, ge=1_000, description="share: what is kept of the record lock for a stopped generation's Response and "
        "its ACCEPT (milliseconds on a healthy broker; more for a slow machine or broker)")
    share_fetch_max_bytes: int = Field(512, ge=1, description="share: bound on one poll (max.poll.records is not)")
    share_consumers: int = Field(0, ge=0, description="share: consumers per priority class; 0 = max_in_flight // 2 "
                                 "(each holds one poll's records until all are acknowledged)")
    poll_timeout_s: float = Field(0.05, gt=0, description="Longest a poll waits; new records return it at once")
    chunk_linger_ms: float = Field(0.5, ge=0, description="Producer linger for chunks and responses (latency-bound)")
    # 100 ms: ~10 updates a second, smooth for a reader. On 2 cores shared with the broker it cut the broker's
    # CPU per round of bench/worker.py's load from 0.19 to 0.13 s and the reader's from 0.04 to 0.02 s, CPU the
    # model's threads get back: ahead of a chunk per token in 5 of 6 A/B runs, by ~0.025 of the engine-alone
    # rate (docs/worker.md, "Chunks and the broker").
    chunk_interval_ms: float = Field(100.0, ge=0, description="At most one token chunk per stream in each window "
                                     "of this length (windows shared by all streams, so a batch sends in one step); "
                                     "the text of later tokens rides on the next chunk. 0 = a chunk per token; the "
                                     "first and last chunks never wait. Fewer produce requests and fetches for the "
                                     "broker")
    grace_s: float = Field(20.0, ge=0, description="On SIGTERM, how long in-flight requests may finish before hand-back")
    heartbeat_s: float = Field(2.0, gt=0, description="WorkerStatus period")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics port; 0 = off")
    metrics_host: str = Field("127.0.0.1", description="Address /metrics listens on: loopback by default; 0.0.0.0 "
                              "in a Kubernetes pod, where the kubelet's probes and Prometheus reach the pod's IP")
    lag_interval_s: float = Field(5.0, gt=0, description="How often the consumer lag of the worker's groups is "
                                  "measured for /metrics (records and seconds, transport/lag.py)")
    session_timeout_ms: int = Field(6000, ge=1000, description="partition: group session timeout (crash detection)")
    cancel_memory: int = Field(10_000, ge=0, description="Cancels remembered for requests not seen yet")
    deletion_memory: int = Field(10_000, ge=0, description="Users whose latest Deletion is remembered, so a "
                                 "request created before it but served after caches nothing")
    adapter_cache: Path = Field(Path.home() / ".cache" / "chatpipe" / "adapters",
                                description="Where the adapters of the model versions this worker serves are copied "
                                "from the artifact store (<name>/<version>/), checked and loaded from")
    version_wait_s: float = Field(30.0, ge=0, description="How long a request for a version whose CANARY/LIVE record "
                                  "this worker has seen waits for its adapter to be fetched and checked")
    kafka_error_budget_s: float = Field(60.0, gt=0, description="How long transient consumer errors (broker "
                                        "away, topic recreated) may go on before the worker exits non-zero")

    @model_validator(mode="after")
    def _check(self) -> "WorkerSettings":
        if self.max_in_flight and self.interactive_reserve >= self.max_in_flight:
            raise ValueError("interactive_reserve must be below max_in_flight")
        if self.share_lock_margin_ms >= self.share_record_lock_ms:
            raise ValueError(f"share_lock_margin_ms ({self.share_lock_margin_ms}) must be below share_record_lock_ms "
                             f"({self.share_record_lock_ms}): a generation would be stopped before it started")
        return self

    def capacity(self, engine_max_batch: int, engine_max_waiting: int) -> tuple[int, int]:
        """(max in flight, in-flight slots batch requests may use). Partition mode reads the backlog into
        the engine's waiting queue, the one place that orders tenants fairly (fair_queue.py): left in
        the topic it would be served in arrival order, and a partition's records can go to no other
        worker anyway. Share mode takes 2 x max_batch: a record's lock runs while it waits, and what
        this worker does not take another may."""
        if self.max_in_flight:
            total = self.max_in_flight
        elif self.intake == "share":
            total = 2 * engine_max_batch
        else:
            total = engine_max_batch + max(engine_max_batch, engine_max_waiting)
        reserve = self.interactive_reserve or max(1, total // 4)
        return total, max(1, total - reserve)
