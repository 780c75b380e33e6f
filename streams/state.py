"""Conversation state as kept in the Faust table ``conversations`` (a changelog-backed table).

One entry per (tenant, user, conversation): the recent turns (the window that always goes into
the context), the requests intake has sent and whose responses are still to come (record needs
their prompt text), the request ids already recorded (a response delivered twice makes one
turn) and counters. Values are plain JSON dicts in the table so the changelog is readable with
any Kafka tool; this module turns them into dataclasses and back. No I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields


def state_key(tenant: str, user_id: str, conversation_id: str) -> str:
    """Table key. The tenant and user are part of it, so another tenant (or user) reusing a
    conversation id never sees this conversation's turns."""
    return json.dumps([tenant, user_id, conversation_id], separators=(",", ":"))


@dataclass(slots=True)
class RecentTurn:
    turn_id: str  # ConversationTurn.event_id, also the Qdrant point's id
    turn_index: int
    prompt: str
    answer: str
    created_at: int  # epoch ms


@dataclass(slots=True)
class PendingRequest:
    request_id: str
    prompt: str
    system_prompt: str | None
    created_at: int  # PromptRequest.created_at, epoch ms
    # False for a raw prompt (PromptRequest v5 raw_prompt): its turn is emitted, never remembered
    # (no memory point, not in the recent window). States written before it read as True.
    remember: bool = True
    # True when intake served it without recalled memory (recall late: intake.py); the turn says so too.
    memory_degraded: bool = False
    # The response cache's key digest (streams/response_cache.py) when its answer may be cached: the record
    # agent stores the answer under it. None: bypassed, or a state written before the cache.
    cache_key: str | None = None


@dataclass(slots=True)
class ConversationState:
    tenant: str
    user_id: str
    conversation_id: str
    turn_count: int = 0  # turns emitted to chat.turns (failed answers included): the next turn_index
    remembered: int = 0  # turns stored in memory (answered with STOP or LENGTH)
    failed: int = 0  # turns whose answer was an error, cancel, timeout or overload
    tokens_in: int = 0
    tokens_out: int = 0
    recent: list[RecentTurn] = field(default_factory=list)  # oldest first
    pending: list[PendingRequest] = field(default_factory=list)  # oldest first
    recorded: list[str] = field(default_factory=list)  # request ids already turned into turns, oldest first
    active_at: int = 0  # created_at of the newest prompt (epoch ms): idle expiry (expiry.py); 0 before the field
    # The exact model its requests go to (a base model or name@version, transport/model_catalog.py): kept
    # while that version is served, so the conversation never changes version mid-thread. None before the field.
    model_version: str | None = None

    @property
    def key(self) -> str:
        return state_key(self.tenant, self.user_id, self.conversation_id)

    # --- transitions -----------------------------------------------------------------------
    def add_pending(self, request: PendingRequest, limit: int) -> PendingRequest | None:
        """Remember a request sent to inference; returns the oldest one evicted past ``limit``."""
        self.pending = [p for p in self.pending if p.request_id != request.request_id]
        self.pending.append(request)
        self.active_at = max(self.active_at, request.created_at)
        if len(self.pending) > limit:
            return self.pending.pop(0)
        return None

    def take_pending(self, request_id: str) -> PendingRequest | None:
        for i, p in enumerate(self.pending):
            if p.request_id == request_id:
                return self.pending.pop(i)
        return None

    def was_recorded(self, request_id: str) -> bool:
        return request_id in self.recorded

    def record(self, request_id: str, turn: RecentTurn | None, *, tokens_in: int, tokens_out: int,
               window: int, dedupe_window: int) -> int:
        """Count one turn (``turn`` None = a failed answer, not remembered); returns its turn_index."""
        index = self.turn_count
        self.turn_count += 1
        self.tokens_in += tokens_in
        self.tokens_out += tokens_out
        self.recorded.append(request_id)
        del self.recorded[:-dedupe_window]
        if turn is None:
            self.failed += 1
        else:
            self.remembered += 1
            self.recent.append(turn)
            if window == 0:
                self.recent.clear()
            else:
                del self.recent[:-window]
        return index

    # --- table value <-> dataclass -----------------------------------------------------------
    def to_value(self) -> dict:
        # The same dict as dataclasses.asdict, built field by field: asdict deep-copies generically
        # and was the costliest step of intake's state write with a full pending list.
        value = {name: getattr(self, name) for name in _SCALARS}
        value["recent"] = [{name: getattr(t, name) for name in _RECENT} for t in self.recent]
        value["pending"] = [{name: getattr(p, name) for name in _PENDING} for p in self.pending]
        value["recorded"] = list(self.recorded)
        return value

    @classmethod
    def from_value(cls, value: dict) -> "ConversationState":
        data = dict(value)
        data["recent"] = [RecentTurn(**t) for t in data.get("recent", [])]
        data["pending"] = [PendingRequest(**p) for p in data.get("pending", [])]
        data["recorded"] = list(data.get("recorded", []))
        return cls(**data)


_RECENT = tuple(f.name for f in fields(RecentTurn))
_PENDING = tuple(f.name for f in fields(PendingRequest))
_SCALARS = tuple(f.name for f in fields(ConversationState) if f.name not in ("recent", "pending", "recorded"))
