"""Idle conversations leave the conversation table, so it stays bounded.

The table lives in memory and is restored whole from its changelog at every start; without an
end it grows by every conversation ever held. Every ``idle_sweep_s`` each worker sweeps its own
keys: a conversation whose last prompt (``ConversationState.active_at``) is older than
``conversation_idle_s`` and that waits for no response is deleted, which writes a tombstone to the
compacted changelog, so a later restore no longer reads it.

What is lost with it: the recent window (the last ``recent_turns`` turns that always go into the
context) and the conversation's counters (a prompt after that starts at turn index 0 again).
Memory keeps every remembered turn, so recall still finds them; the archive and ``chat.turns``
keep the history. A state written before ``active_at`` existed is dated by its newest recent turn
(one with none is kept).

The sweep takes the state lock for ``chunk`` keys at a time, so intake and record wait at most
one chunk. No Faust here: the table is any mapping; ``streams/app.py`` runs ``sweep`` on a timer.
Tests: tests/streams/test_agent_logic.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, MutableMapping

log = logging.getLogger(__name__)


def last_active_ms(value: dict[str, Any]) -> int:
    """When a stored state last had a prompt (epoch ms); 0 when it cannot tell."""
    return value.get("active_at") or max((t.get("created_at", 0) for t in value.get("recent", [])), default=0)


class IdleExpiry:
    def __init__(self, table: MutableMapping[str, Any], lock: Callable[[], asyncio.Lock], idle_s: float, *,
                 chunk: int = 1000, clock: Callable[[], float] = time.time) -> None:
        self.table = table
        self.lock = lock  # the state lock, asked for at each sweep (StreamsServices makes it in the worker's loop)
        self.idle_s = idle_s
        self.chunk = chunk
        self.clock = clock
        self.expired = 0  # conversations removed so far (a counter: chatpipe_streams_records)

    async def sweep(self) -> int:
        """Removes the idle conversations of this worker's table; returns how many."""
        cutoff_ms = (self.clock() - self.idle_s) * 1000
        keys = list(self.table.keys())
        removed = 0
        for start in range(0, len(keys), self.chunk):
            async with self.lock():
                for key in keys[start:start + self.chunk]:
                    value = self.table.get(key)
                    if value is None or value.get("pending"):  # forgotten meanwhile, or a response to come
                        continue
                    if 0 < last_active_ms(value) < cutoff_ms:
                        del self.table[key]
                        removed += 1
            await asyncio.sleep(0)  # intake and record take the lock between chunks
        self.expired += removed
        if removed:
            log.info("%d idle conversations left the table (idle over %g s); %d kept", removed, self.idle_s,
                     len(keys) - removed)
        return removed
