"""Asyncio facade over the engine: the step loop runs in one background thread, each request's
``TokenEvent``s (or text increments) arrive on its own async iterator.

The thread is the only caller of ``Engine.step``; submissions and cancellations from the event
loop go through the scheduler's lock, so a step is never blocked by callers for longer than a
queue append. Leaving an ``async for`` early (break, task cancelled, client gone) cancels the
request, and its KV cache is freed at the next step.

Not here: Kafka, HTTP, request ids from outside (the worker and gateway add those).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence

from inference.engine.engine import Engine, TokenEvent
from inference.engine.request import Admission, FinishReason, Priority, RequestTimings, SamplingParams
from inference.engine.text import IncrementalDetokenizer, StopStringMatcher


class AsyncEngine:
    def __init__(self, engine: Engine, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self._idle_wait_s = idle_wait_s
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[TokenEvent | BaseException]]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="chatpipe-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    async def __aenter__(self) -> AsyncEngine:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)

    def submit(
        self, prompt_token_ids: Sequence[int], params: SamplingParams = SamplingParams(),
        priority: Priority = Priority.INTERACTIVE, request_id: str | None = None,
    ) -> RequestStream:  # fmt: skip
        """Queue a request; look at ``.admission`` before iterating (a refused stream is empty)."""
        queue: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        with self._lock:  # registered before the engine can produce its first event
            admission, req = self.engine.add_request(prompt_token_ids, params, priority, request_id)
            if admission is Admission.ACCEPTED:
                self._queues[req.request_id] = (loop, queue)
        self._wake.set()
        return RequestStream(self, req.request_id, admission, queue)

    def cancel(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.engine.has_work():
                self._wake.wait(self._idle_wait_s)
                self._wake.clear()
                continue
            try:
                events = self.engine.step()
            except BaseException as exc:  # hand the failure to every waiting caller, then stop
                with self._lock:
                    targets, self._queues = list(self._queues.values()), {}
                for loop, q in targets:
                    loop.call_soon_threadsafe(q.put_nowait, exc)
                raise
            with self._lock:
                for ev in events:
                    target = self._queues.pop(ev.request_id, None) if ev.finished else self._queues.get(ev.request_id)
                    if target is not None:
                        loop, q = target
                        loop.call_soon_threadsafe(q.put_nowait, ev)


class RequestStream:
    """Async iterator of one request's ``TokenEvent``s; the last one has ``finished=True``."""

    def __init__(self, owner: AsyncEngine, request_id: str, admission: Admission, queue: asyncio.Queue) -> None:
        self.owner = owner
        self.request_id = request_id
        self.admission = admission
        self._queue = queue
        self._done = admission is not Admission.ACCEPTED

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[TokenEvent]:
        try:
            while not self._done:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    raise item
                self._done = item.finished
                yield item
        finally:
            if not self._done:  # the consumer left early: free the request's cache
                self._done = True
                self.owner.cancel(self.request_id)

    def cancel(self) -> None:
        if not self._done:
            self.owner.cancel(self.request_id)


@dataclass(frozen=True)
class TextDelta:
    text: str  # new text since the previous delta (may be empty on the final one)
    finished: bool = False
    finish_reason: FinishReason | None = None
    timings: RequestTimings | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0


async def stream_text(
    aengine: AsyncEngine, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams = SamplingParams(),
    stop: Sequence[str] = (), priority: Priority = Priority.INTERACTIVE,
) -> AsyncIterator[TextDelta]:  # fmt: skip
    """Text increments of one generation; a stop string ends it (reason STOP) and is not shown.
    Raises ``RuntimeError`` naming the reason when the engine refuses the request."""
    stream = aengine.submit(prompt_token_ids, params, priority)
    if stream.admission is not Admission.ACCEPTED:
        raise RuntimeError(f"request refused: {stream.admission.value}")
    detok, stops = IncrementalDetokenizer(tokenizer), StopStringMatcher(stop)
    events = stream.__aiter__()
    try:
        async for ev in events:
            text = stops.feed(detok.push(ev.token_id)) if ev.token_id is not None else ""
            if stops.stopped:
                stream.cancel()
                yield TextDelta(text, True, FinishReason.STOP, ev.timings, ev.num_prompt_tokens, len(detok.token_ids))
                return
            if ev.finished:
                yield TextDelta(text + stops.flush(), True, ev.finish_reason, ev.timings,
                                ev.num_prompt_tokens, ev.num_output_tokens)  # fmt: skip
                return
            if text:
                yield TextDelta(text)
    finally:
        await events.aclose()
