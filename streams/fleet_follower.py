"""The workers' load for streams intake: every ``WorkerStatus`` on ``chat.workers.status`` into a ``Fleet``.

A prompt produced straight to ``chat.prompts`` (no gateway admitted it) with a ``deadline_at`` the
fleet cannot meet is refused by intake at once, with the estimate (``intake.py``), the way the
gateway answers 429 ``deadline_unreachable``; the estimate is the gateway's (``transport/fleet.py``),
from the reports this follower keeps current. A broadcast listener (``transport/broadcast.py``): every
streams worker hears every report, from the end (the first reports arrive within a heartbeat; until
then nothing is refused). If its thread dies the app exits unacked (code 75), as for the erasure
follower: a worker that no longer hears the reports must not go on refusing by an old picture.
"""

from __future__ import annotations

from schemas.records import WorkerStatus
from schemas.topics import WORKERS_STATUS
from transport.broadcast import BroadcastListener
from transport.settings import IDLE_FETCH_WAIT_MS


class FleetFollower(BroadcastListener):
    """Hands each report to ``Fleet.update`` in its own thread (``start(None, ...)``: the fleet locks)."""

    topic, record_type, thread_name, fetch_wait_ms = WORKERS_STATUS, WorkerStatus, "chatpipe-fleet", IDLE_FETCH_WAIT_MS
