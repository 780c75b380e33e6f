"""How intake answers a prompt from the response cache: through the normal reply path, no worker.

A hit is answered as a worker answers (``inference/worker/replies.py``), so nothing downstream
needs to know: one final ``TokenChunk`` with the whole text to the asker's reply address (finish
reason, usage, ``cached_tokens`` = every prompt token, ``response_cached``, ``worker_id``
``streams.response-cache``), and a ``Response`` on ``chat.responses`` flagged the same way, from which
the record agent records the turn as usual (its pending entry was written with the others of the batch).

The chunk goes through the transport producer that refusals use (``refusals.py`` says why not
Faust's), awaited within the retry budget; a reply address that vanished meanwhile loses only the
chunk (logged), the Response and the turn stand. The Response goes through the batch's outbox, so the
batch is acked only once it is on the broker.
"""

from __future__ import annotations

import time
from typing import Any

from schemas.records import FinishReason, InferenceRequest, Response, TokenChunk, now_ms
from streams.faults import Retrier
from streams.refusals import send_chunk_or_log
from streams.response_cache import CACHE_WORKER_ID, CachedAnswer
from transport.acked_writer import AckedWriter
from transport.reply_address import ReplyAddresses


class CachedAnswers:
    def __init__(self, reply_producer: AckedWriter | None, replies: ReplyAddresses | None, retrier: Retrier,
                 responses_topic: Any, codec: Any) -> None:
        self.reply_producer = reply_producer  # None: no chunks (tests without a reply producer)
        self.replies = replies
        self.retrier = retrier
        self.responses_topic = responses_topic
        self.codec = codec
        self.answered = 0

    async def answer(self, message: Any, out: InferenceRequest, entry: CachedAnswer, outbox: Any,
                     parent_trace: str | None, started: float) -> None:
        """Answer ``out`` with ``entry``: the chunk to its reply address, its Response to the outbox.
        ``started``: perf_counter when intake took the batch (the Response's ttft and total time)."""
        finish = FinishReason(entry.finish_reason)
        if out.reply_to and self.reply_producer is not None:
            chunk = TokenChunk(request_id=out.request_id, conversation_id=out.conversation_id, index=0,
                               text=entry.text, is_final=True, worker_id=CACHE_WORKER_ID, finish_reason=finish,
                               tokens_in=entry.tokens_in, tokens_out=entry.tokens_out,
                               cached_tokens=entry.tokens_in, response_cached=True)
            await self.retrier.call(f"cached answer for request {out.request_id}", send_chunk_or_log,
                                    self.reply_producer, self.replies, message, out, chunk, "the cached answer's chunk",
                                    "its turn is recorded")
        elapsed_ms = (time.perf_counter() - started) * 1e3
        response = Response(
            request_id=out.request_id, conversation_id=out.conversation_id, user_id=out.user_id, tenant=out.tenant,
            text=entry.text, model=entry.model, worker_id=CACHE_WORKER_ID, tokens_in=entry.tokens_in,
            tokens_out=entry.tokens_out, queue_ms=0.0, ttft_ms=elapsed_ms, total_ms=elapsed_ms, finish_reason=finish,
            created_at=out.created_at, completed_at=now_ms(), cached_tokens=entry.tokens_in, response_cached=True)
        await outbox.send(self.responses_topic, key=out.conversation_id.encode(), value=self.codec.encode(response),
                          parent_trace=parent_trace)
        self.answered += 1
