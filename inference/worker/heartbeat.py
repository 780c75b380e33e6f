"""``WorkerStatus`` heartbeats to ``chat.workers.status`` (compacted, keyed by worker_id): what a
router or autoscaler reads to see each worker's load, and what the gateway's admission estimates a new
request's wait from (transport/fleet.py): the queued and running work in tokens, the measured throughput.

Work taken from Kafka but not handed to the engine yet (being prepared) counts in ``waiting`` but
not in the token sums; the gateway counts its own not-started requests itself."""

from __future__ import annotations

from inference.engine.engine import EngineStats
from schemas.records import WorkerState, WorkerStatus


def worker_status(worker_id: str, model: str, state: WorkerState, stats: EngineStats, in_flight: int,
                  model_versions: list[str] | None = None) -> WorkerStatus:
    return WorkerStatus(
        worker_id=worker_id, model=model, state=state, running=stats.running,
        # taken from Kafka but not running yet: the engine's waiting queue and what is on its way in
        waiting=max(stats.waiting, in_flight - stats.running),
        kv_cache_used_tokens=stats.kv_used_tokens, kv_cache_total_tokens=stats.kv_capacity_tokens,
        tokens_per_s=float(stats.tokens_per_s),
        max_running=stats.max_running, queued_prompt_tokens=stats.queued_prompt_tokens,
        queued_output_tokens=stats.queued_output_tokens, running_output_tokens=stats.running_output_tokens,
        decode_tokens_per_s=stats.decode_tokens_per_s, prefill_tokens_per_s=stats.prefill_tokens_per_s,
        model_versions=list(model_versions or ()),
    )
