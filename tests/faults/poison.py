"""Poison records: one of each kind the failure policy names, on each input topic a tier decodes.

Each is produced with the plain confluent-kafka producer (as any application could), and its
offset is kept, so the test can find its dead letter by source topic, partition and offset.
``reply_request_id`` names the ones whose reply address works: they must also get a final error
chunk there.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from confluent_kafka import Producer

from schemas.codec import default_codec
from schemas.records import (ChatMessage, FinishReason, InferenceRequest, PromptRequest, Response, SamplingParams,
                             now_ms)
from tests.faults.ledger import REPLY_TOPIC

GARBAGE = b"\x00not an avro record at all"
LONG_TEXT = "word " * 6000  # far beyond the 1024-token context of the fault stack


@dataclass
class Poison:
    topic: str
    kind: str
    value: bytes | None
    key: bytes
    reply_request_id: str | None = None  # its reply address works: an error final chunk is due there
    partition: int | None = None  # where it landed
    offset: int | None = None


def _prompt(kind: str, **overrides) -> PromptRequest:
    fields = dict(conversation_id=f"poison-{kind}", user_id="poison-user", tenant="faults", model="smollm2-135m-instruct",
                  messages=[ChatMessage("user", "hello")], sampling=SamplingParams(max_tokens=4, temperature=0.0),
                  reply_to=REPLY_TOPIC, reply_partition=0)
    return PromptRequest(**{**fields, **overrides})


def _request(kind: str, **overrides) -> InferenceRequest:
    fields = dict(request_id=uuid.uuid4().hex, conversation_id=f"poison-{kind}", user_id="poison-user", tenant="faults",
                  created_at=now_ms(), model="smollm2-135m-instruct", messages=[ChatMessage("user", "hello")],
                  sampling=SamplingParams(max_tokens=4, temperature=0.0), reply_to=REPLY_TOPIC, reply_partition=0)
    return InferenceRequest(**{**fields, **overrides})


def poisons() -> list[Poison]:
    codec = default_codec()
    out: list[Poison] = []

    def add(topic: str, kind: str, record=None, *, value: bytes | None = None, answerable: bool = False) -> None:
        data = codec.encode(record) if record is not None else value
        key = (getattr(record, "conversation_id", None) or f"poison-{kind}").encode()
        out.append(Poison(topic, kind, data, key, record.request_id if answerable else None))

    nowhere = f"chat.replies.nowhere-{uuid.uuid4().hex[:6]}"
    # chat.prompts (streams intake)
    add("chat.prompts", "undecodable", value=GARBAGE)
    add("chat.prompts", "tombstone", value=None)
    add("chat.prompts", "invalid: no messages", _prompt("invalid", messages=[]), answerable=True)
    add("chat.prompts", "reply partition outside its topic", _prompt("bad-partition", reply_partition=97))
    add("chat.prompts", "reply topic that does not exist", _prompt("bad-topic", reply_to=nowhere))
    add("chat.prompts", "over-size prompt", _prompt("too-long", messages=[ChatMessage("user", LONG_TEXT)]),
        answerable=True)
    add("chat.prompts", "expired", _prompt("expired", deadline_at=now_ms() - 60_000), answerable=True)
    # chat.inference.requests (+ batch): the worker
    for topic in ("chat.inference.requests", "chat.inference.requests.batch"):
        add(topic, "undecodable", value=GARBAGE)
        add(topic, "tombstone", value=None)
    add("chat.inference.requests", "invalid sampling", _request("bad-sampling", sampling=SamplingParams(max_tokens=0)),
        answerable=True)
    add("chat.inference.requests", "reply partition outside its topic", _request("bad-partition", reply_partition=97))
    add("chat.inference.requests", "reply topic that does not exist", _request("bad-topic", reply_to=nowhere))
    add("chat.inference.requests", "over-size prompt",
        _request("too-long", messages=[ChatMessage("user", LONG_TEXT)]), answerable=True)
    add("chat.inference.requests", "expired", _request("expired", deadline_at=now_ms() - 60_000), answerable=True)
    # chat.responses (streams record)
    add("chat.responses", "undecodable", value=GARBAGE)
    add("chat.responses", "response to an unknown request",
        Response(request_id=uuid.uuid4().hex, conversation_id="poison-unknown", user_id="poison-user", tenant="faults",
                 created_at=now_ms(), model="smollm2-135m-instruct", text="?", worker_id="nobody",
                 finish_reason=FinishReason.STOP, tokens_in=1, tokens_out=1, queue_ms=0, ttft_ms=0, total_ms=0))
    # chat.deletions (streams forget), chat.cancels (the worker's cancel listener)
    add("chat.deletions", "undecodable", value=GARBAGE)
    add("chat.cancels", "undecodable", value=GARBAGE)
    return out


# The fault stack's worker raises RuntimeError, as a bug would, on a request whose last message is this
# (CHATPIPE_WORKER_DRILL_CRASH_ON, stack.py): the record that crash-loops the worker until it is dead-lettered.
CRASH_DRILL_TEXT = "fault drill: crash the worker"


def crash_drill() -> Poison:
    """A request the worker crashes on (an unclassified exception, not the record's fault by any rule)."""
    record = _request("crash-drill", messages=[ChatMessage("user", CRASH_DRILL_TEXT)])
    return Poison("chat.inference.requests", "crashes the worker", default_codec().encode(record),
                  record.conversation_id.encode(), record.request_id)


def produce(bootstrap: str, records: list[Poison]) -> list[Poison]:
    """Produce each and wait until the broker has it; fills in partition and offset."""
    producer = Producer({"bootstrap.servers": bootstrap, "partitioner": "murmur2_random"})
    for poison in records:
        def delivered(err, msg, poison=poison) -> None:
            assert err is None, f"poison {poison.kind} on {poison.topic} not delivered: {err}"
            poison.partition, poison.offset = msg.partition(), msg.offset()
        producer.produce(poison.topic, poison.value, key=poison.key, on_delivery=delivered)
    assert producer.flush(30) == 0, "poison records not delivered"
    return records
