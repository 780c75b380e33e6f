"""One generation on the engine, as text increments, cancellable by id from outside.

``inference.engine.streaming.stream_text`` does the same but picks its own engine request id and
hides the stream, so a Cancel arriving from Kafka could not reach it. This adapter submits with
an id of ours, keeps the ``RequestStream`` (``cancel()`` stops it at the next engine step and
frees its cache) and reports the first token (the request is running, no longer waiting).

Text comes from the engine's ``TextStream`` (built in the engine's step, which also ends the
request at the token completing a stop string); the Response's text is the concatenation of
exactly the increments streamed, so a reader's assembled stream equals it by construction.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from inference.engine.block_allocator import DEFAULT_TENANT
from inference.engine.request import Admission, FinishReason
from inference.engine.streaming import AsyncEngine
from inference.engine.text import TextStream
from inference.worker.errors import InvalidRequestError, PromptTooLongError
from inference.worker.prompts import PreparedRequest


class EngineBusy(Exception):
    """The engine's waiting queue is full (Admission.OVERLOADED): try again shortly."""


@dataclass(frozen=True, slots=True)
class Delta:
    text: str
    token_id: int | None
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    queue_s: float | None = None  # engine-internal timings (monotonic seconds)
    tpot_s: float | None = None


class Generation:
    def __init__(self, aengine: AsyncEngine, tokenizer: Any, engine_request_id: str, prepared: PreparedRequest,
                 on_first_token: Callable[[], None] = lambda: None, *, tenant: str = DEFAULT_TENANT,
                 user_id: str = "", cache_prefix: bool = True,
                 on_token: Callable[[float | None], None] = lambda gap_s: None) -> None:
        self.aengine = aengine
        self.tenant = tenant  # salts the prefix cache: only this tenant's requests share its blocks
        self.user_id = user_id  # whose blocks they are (a Deletion of the user drops them)
        self.cache_prefix = cache_prefix  # False: a request its user's Deletion covers caches nothing
        self.tokenizer = tokenizer
        self.engine_request_id = engine_request_id
        self.prepared = prepared
        self.on_first_token = on_first_token
        # Each token as it reaches the worker, with the seconds since the previous one (None for the
        # first): the inter-token latency a streaming client sees, measured where vLLM measures it.
        self.on_token = on_token
        self.cancelled = False
        self.stop_reason: str | None = None  # why it was cancelled: "cancelled", "deadline", "lock", ...
        self.tokens = 0  # token events received so far
        self.tokens_at_cancel: int | None = None
        self._stream = None

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop at the engine's next step; the first reason given is the one kept."""
        if not self.cancelled:
            self.cancelled, self.tokens_at_cancel, self.stop_reason = True, self.tokens, reason
        if self._stream is not None:
            self._stream.cancel()

    async def deltas(self) -> AsyncIterator[Delta]:
        p = self.prepared
        text_stream = TextStream(self.tokenizer, p.stop)  # the engine's step builds the text and stops on it
        try:
            stream = self.aengine.submit(p.prompt_ids, p.params, p.priority, request_id=self.engine_request_id,
                                         text_stream=text_stream, tenant=self.tenant, user_id=self.user_id,
                                         cache_prefix=self.cache_prefix)
        except ValueError as exc:  # the engine's InvalidRequestError: it can never run this request
            raise InvalidRequestError(str(exc)) from None
        if stream.admission is Admission.OVERLOADED:
            raise EngineBusy()
        if stream.admission is not Admission.ACCEPTED:
            raise PromptTooLongError(str(stream.refusal))  # names the token counts and the limit
        self._stream = stream
        if self.cancelled:  # a cancel came while we were submitting
            stream.cancel()
        first = True
        last_at = 0.0
        events = stream.__aiter__()
        try:
            async for ev in events:
                if ev.token_id is not None:
                    self.tokens += 1
                    now = time.perf_counter()
                    self.on_token(None if first else now - last_at)
                    last_at = now
                    if first:
                        first = False
                        self.on_first_token()
                # A stop string ends the request in the engine's step that completes it (reason STOP).
                text = ev.text or ""
                if ev.finished:
                    yield self._final(text, ev.finish_reason, ev, ev.num_output_tokens)
                    return
                yield Delta(text, ev.token_id)
        finally:
            await events.aclose()

    def _final(self, text: str, reason: FinishReason | None, ev: Any, n_out: int) -> Delta:
        t = ev.timings
        return Delta(text, ev.token_id, True, reason, ev.num_prompt_tokens or len(self.prepared.prompt_ids), n_out,
                     queue_s=t.queue_time if t is not None else None,
                     tpot_s=t.tpot(n_out) if t is not None else None)
