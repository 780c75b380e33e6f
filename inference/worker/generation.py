"""One generation on the engine, as text increments, cancellable by id from outside.

``inference.engine.streaming.stream_text`` does the same but picks its own engine request id and
hides the stream, so a Cancel arriving from Kafka could not reach it. This adapter submits with
an id of ours, keeps the ``RequestStream`` (``cancel()`` stops it at the next engine step and
frees its cache) and reports the first token (the request is running, no longer waiting).

Text comes from the engine's ``TextStream`` (built in the engine's step, which also ends the
request at the token completing a stop string); the Response's text is the concatenation of
exactly the increments streamed, so a reader's assembled stream equals it by construction.

Issue 23: a ``Generation`` is one choice of a request (``choice_index``); ``n`` > 1 runs n of them
(``Choices``), submitted together with ``AsyncEngine.submit_group`` so the siblings take the
prompt's KV from the first one's prefix-cache blocks (sibling i > 0 is seeded ``seed + i`` by the
engine: the choices differ and each is reproducible). A choice may carry a grammar matcher
(``constraint``, for response_format). With logprobs each
token's ``Delta`` carries its ``TokenLogprob`` (text and bytes from ``token_bytes.TokenBytes``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from inference.engine.block_allocator import DEFAULT_TENANT
from inference.engine.request import Admission, FinishReason
from inference.engine.streaming import AsyncEngine
from inference.engine.text import TextStream
from inference.worker.errors import InvalidRequestError, PromptTooLongError
from inference.worker.prompts import PreparedRequest
from inference.worker.token_bytes import TokenBytes
from schemas.records import TokenLogprob, TopLogprob


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
    logprob: TokenLogprob | None = None  # of token_id, when the request asked for logprobs
    error: str | None = None  # why the engine ended it with FinishReason.ERROR
    # final one: prompt tokens the engine took from its prefix cache (its first admission's:
    # ``Request.num_cached_tokens``); the final chunk's and Response's ``cached_tokens``
    num_cached_tokens: int = 0


class Generation:
    def __init__(self, aengine: AsyncEngine, tokenizer: Any, engine_request_id: str, prepared: PreparedRequest,
                 on_first_token: Callable[[], None] = lambda: None, *, tenant: str = DEFAULT_TENANT,
                 user_id: str = "", cache_prefix: bool = True,
                 on_token: Callable[[float | None], None] = lambda gap_s: None, constraint: Any = None,
                 token_bytes: TokenBytes | None = None) -> None:
        self.aengine = aengine
        self.constraint = constraint  # a grammar matcher (response_format), or None
        self.token_bytes = token_bytes  # set: each Delta carries its token's logprob
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
        self._stream: Any = None  # its engine stream, once submitted (alone, or in its request's group)

    def attach(self, stream: Any) -> None:
        """Use ``stream`` (one of a group submitted by ``Choices.submit``) instead of submitting."""
        self._stream = stream

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop at the engine's next step; the first reason given is the one kept."""
        if not self.cancelled:
            self.cancelled, self.tokens_at_cancel, self.stop_reason = True, self.tokens, reason
        if self._stream is not None:
            self._stream.cancel()

    async def deltas(self) -> AsyncIterator[Delta]:
        if self._stream is None:
            self._stream = submit_group([self])[0]
        stream = self._stream
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
                logprob = self._logprob(ev)
                if ev.finished:
                    yield self._final(text, ev, logprob)
                    return
                yield Delta(text, ev.token_id, logprob=logprob)
        finally:
            await events.aclose()

    def _final(self, text: str, ev: Any, logprob: TokenLogprob | None) -> Delta:
        t, n_out = ev.timings, ev.num_output_tokens
        return Delta(text, ev.token_id, True, ev.finish_reason, ev.num_prompt_tokens or len(self.prepared.prompt_ids),
                     n_out, queue_s=t.queue_time if t is not None else None,
                     tpot_s=t.tpot(n_out) if t is not None else None, logprob=logprob,
                     error=getattr(ev, "error", None), num_cached_tokens=getattr(ev, "num_cached_tokens", 0))

    def _logprob(self, ev: Any) -> TokenLogprob | None:
        """The event's token as a TokenLogprob (text, bytes, alternatives), when logprobs are on."""
        value = getattr(ev, "logprob", None)
        if self.token_bytes is None or ev.token_id is None or value is None:
            return None
        of = self.token_bytes.of
        text, raw = of(ev.token_id)
        top = []
        for token_id, lp in getattr(ev, "top_logprobs", None) or ():
            alt_text, alt_raw = of(token_id)
            top.append(TopLogprob(alt_text, float(lp), alt_raw))
        return TokenLogprob(text, float(value), raw, top)


def submit_group(generations: list[Generation]) -> list[Any]:
    """Submit the choices of one request as one engine group (``AsyncEngine.submit_group``: the
    siblings take the prompt's KV from the first one's prefix-cache blocks); their streams, in
    order. Raises ``EngineBusy`` (the engine's queue is full), ``InvalidRequestError`` (the engine
    can never run it) or ``PromptTooLongError``."""
    first = generations[0]
    p = first.prepared
    constraints = [g.constraint for g in generations]
    try:
        streams = first.aengine.submit_group(
            [g.engine_request_id for g in generations], p.prompt_ids, p.params, p.priority,
            # a fresh text edge per choice: the engine's step builds its text and stops on its stop strings
            text_streams=[TextStream(g.tokenizer, p.stop) for g in generations],
            tenant=first.tenant, user_id=first.user_id, cache_prefix=first.cache_prefix,
            share_weight=p.share_weight, constraints=constraints if any(c is not None for c in constraints) else None,
            adapter=p.adapter)
    except ValueError as exc:  # the engine's InvalidRequestError: it can never run this request
        raise InvalidRequestError(str(exc)) from None
    admission = streams[0].admission  # all accepted or all refused
    if admission is Admission.OVERLOADED:
        raise EngineBusy()
    if admission is not Admission.ACCEPTED:
        raise PromptTooLongError(str(streams[0].refusal))  # names the token counts and the limit
    return streams


class Choices:
    """The n generations of one request, submitted and cancelled together (a Cancel, a revoke, a
    deadline)."""

    def __init__(self, generations: list[Generation]) -> None:
        self.generations = generations

    async def submit(self, before_each_try: Callable[[], None] = lambda: None) -> None:
        """Submit all choices as one engine group and attach each its stream; waits while the
        engine's queue is full (``before_each_try`` may raise, e.g. at the deadline)."""
        while True:
            before_each_try()
            try:
                streams = submit_group(self.generations)
                break
            except EngineBusy:
                await asyncio.sleep(0.05)
        for gen, stream in zip(self.generations, streams):
            gen.attach(stream)
            if gen.cancelled:  # a cancel came while we were submitting
                stream.cancel()

    def cancel(self, reason: str = "cancelled") -> None:
        for gen in self.generations:
            gen.cancel(reason)
