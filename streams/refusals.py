"""How intake turns a prompt away: a dead letter with the reason, and a final error chunk where it can.

A refused request is answered, never dropped (the failure policy in docs/architecture.md): its
dead letter goes through the batch's outbox, and a lone final ``TokenChunk`` (``is_final``,
``error_code``, the reason) goes to the asker's reply address, so a client waiting there gets
the reason at once instead of its timeout. Where the reply address itself is unusable (no such
topic, partition outside it) only the dead letter is possible, and it says so.

Refused here, before anything else is done with the request:

- an unusable reply address: ``InvalidReplyAddressError``, dead letter only;
- a passed deadline: ``ExpiredRequestError``, chunk with finish reason TIMEOUT, code ``expired``.

Intake refuses through ``refuse`` as well once the prompt is parsed (invalid, too long).

The chunk goes through a transport (confluent-kafka) producer, not Faust's: the first send of
aiokafka's producer to a topic it has no metadata for narrows its metadata to that topic, after
which Faust's changelog writes fail for good (reply topics are created by their readers at any
time). It is awaited before the batch is acked, retried while the broker is away; when it fails
because the address vanished since it was checked (a gateway gone with its topic), the dead
letter is the answer.
"""

from __future__ import annotations

import logging
from typing import Any

from schemas.records import FinishReason, PromptRequest, TokenChunk, now_ms
from streams.dead_letters import DeadLetters, child_headers
from streams.errors import ExpiredRequestError, InvalidReplyAddressError
from streams.faults import Retrier
from transport.reply_address import ReplyAddresses
from transport.acked_writer import AckedWriter
from transport.errors import DeliveryError

log = logging.getLogger(__name__)
COMPONENT = "streams.intake"


async def reply_problem(replies: ReplyAddresses | None, retrier: Retrier, message: Any, request: Any) -> str | None:
    """Why ``request``'s reply address cannot be answered (looked up within the retry budget); None when it
    can, or when reply addresses are not checked (``replies`` None)."""
    if replies is None:
        return None
    return await retrier.call("reply address lookup", replies.problem, request.reply_to, request.reply_partition,
                              sent_at_s=message.timestamp)


async def send_reply(producer: AckedWriter, replies: ReplyAddresses | None, message: Any, request: Any,
                     record: Any, unchecked: str | None = None) -> str | None:
    """Send ``record`` to ``request``'s reply address, awaited (durable before the request is acked): None once
    the broker has it; why the address is unusable when it vanished since it was checked (``unchecked``
    where reply addresses are not checked). A broker that failed raises, for the caller's retrier."""
    try:
        await producer.send(request.reply_to, record, key=request.request_id, partition=request.reply_partition,
                            headers=child_headers(message))
    except DeliveryError:
        gone = unchecked if replies is None else await replies.problem(request.reply_to, request.reply_partition,
                                                                       fresh=True)
        if gone is None:
            raise  # the address exists: the broker failed; retried
        return gone
    return None


async def send_chunk_or_log(producer: AckedWriter, replies: ReplyAddresses | None, message: Any, request: Any,
                            chunk: Any, what: str, stands: str) -> None:
    """``send_reply`` of a lone chunk; a reply address that vanished is logged (``what`` was not delivered,
    ``stands`` is the answer that remains) instead of raised. A broker that failed raises, for the retrier."""
    gone = await send_reply(producer, replies, message, request, chunk, unchecked="unknown: reply addresses are not "
                            "checked")
    if gone is not None:
        log.warning("request %s: %s not delivered, the reply address is unusable (%s); %s", request.request_id,
                    what, gone, stands)


class Refusals:
    def __init__(self, dead_letters: DeadLetters, retrier: Retrier, reply_producer: AckedWriter | None,
                 replies: ReplyAddresses | None) -> None:
        self.dead_letters = dead_letters
        self.retrier = retrier
        self.reply_producer = reply_producer  # None: no error chunks (dead letters only)
        self.replies = replies  # None: reply addresses are not checked
        self.expired = 0
        self.unanswerable = 0

    async def admit(self, message: Any, request: PromptRequest, outbox: Any) -> bool:
        """True when the request may be served; otherwise it has been refused (and answered)."""
        if (problem := await reply_problem(self.replies, self.retrier, message, request)) is not None:
            self.unanswerable += 1
            await self.dead_letters.send(message, InvalidReplyAddressError(
                f"PromptRequest {request.request_id}: {problem}; no error chunk was sent, the reply "
                "address itself cannot be answered"), outbox)
            return False
        now = now_ms()
        if request.deadline_at is not None and request.deadline_at < now:
            self.expired += 1
            await self.refuse(message, request, ExpiredRequestError(
                f"PromptRequest {request.request_id}: deadline passed {now - request.deadline_at} ms before intake "
                "took it"), "expired", outbox, finish=FinishReason.TIMEOUT)
            return False
        return True

    async def refuse(self, message: Any, request: PromptRequest, exc: Exception, error_code: str, outbox: Any,
                     finish: FinishReason = FinishReason.ERROR) -> None:
        """Dead letter with the reason, and a lone final error chunk to the reply address (if any)."""
        await self.dead_letters.send(message, exc, outbox)
        if not request.reply_to or self.reply_producer is None:
            return
        chunk = TokenChunk(request_id=request.request_id, conversation_id=request.conversation_id, index=0,
                           text="", is_final=True, worker_id=COMPONENT, finish_reason=finish,
                           tokens_in=0, tokens_out=0, error_code=error_code, error=str(exc))
        await self.retrier.call(f"error chunk for request {request.request_id}", send_chunk_or_log,
                                self.reply_producer, self.replies, message, request, chunk, "error chunk",
                                "the dead letter stands")
