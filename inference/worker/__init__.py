"""The Kafka inference worker around the engine (``chatpipe inference``); see docs/worker.md.

    settings.py          WorkerSettings (CHATPIPE_WORKER_*)
    worker.py            the asyncio service: intake -> engine -> chunks, Response, commit
    intake.py            WorkItem, Outcome, what both intake modes share
    intake_partition.py  consumer group: pause/resume backpressure, per-partition commits, revoke
    intake_share.py      share group (KIP-932): ACCEPT / RELEASE / REJECT per record
    capacity.py          how much to take, per priority class (pure policy + a locked counter)
    offsets.py           lowest-unfinished-offset tracking (pure)
    prompts.py           request -> prompt ids (chat template) + sampling, with named rejections
    generation.py        one cancellable generation on the engine, as text increments
    replies.py           TokenChunks, Responses, dead letters
    cancels.py           chat.cancels, read in full by every worker
    deletions.py         chat.deletions, read in full by every worker: the user's prefix blocks dropped, audited
    heartbeat.py         WorkerStatus
    metrics.py           Prometheus metrics

Depends on ``schemas``, ``transport`` and the public API of ``inference.engine``.
"""
