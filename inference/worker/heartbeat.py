"""``WorkerStatus`` heartbeats to ``chat.workers.status`` (compacted, keyed by worker_id): what a
router or autoscaler reads to see each worker's load."""

from __future__ import annotations

from inference.engine.engine import EngineStats
from schemas.records import WorkerState, WorkerStatus


def worker_status(worker_id: str, model: str, state: WorkerState, stats: EngineStats, in_flight: int) -> WorkerStatus:
    return WorkerStatus(
        worker_id=worker_id, model=model, state=state, running=stats.running,
        # taken from Kafka but not running yet: the engine's waiting queue and what is on its way in
        waiting=max(stats.waiting, in_flight - stats.running),
        kv_cache_used_tokens=stats.kv_used_tokens, kv_cache_total_tokens=stats.kv_capacity_tokens,
        tokens_per_s=float(stats.tokens_per_s),
    )
