"""Asyncio facade over the engine: the step loop runs in one background thread, each request's
``TokenEvent``s (or text increments) arrive on its own async iterator.

The thread is the only caller of ``Engine.step``; submissions and cancellations from the event
loop go through the scheduler's lock, so a step is never blocked by callers for longer than a
queue append. Leaving an ``async for`` early (break, task cancelled, client gone) cancels the
request, and its KV cache is freed at the next step. Commands that change the cache itself
(``forget_prefixes``) are queued and run by the step thread between two steps. A failing step or
``stop()`` ends every open stream with a named error (``EngineFailed`` / ``EngineStopped``),
never with silence.

Not here: Kafka, HTTP, request ids from outside (the worker and gateway add those).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue as queue_module
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Sequence

from inference.engine.block_allocator import DEFAULT_TENANT
from inference.engine.engine import Engine, TokenEvent
from inference.engine.errors import EngineFailed, EngineStopped, RequestRefused
from inference.engine.openmp import release_thread_pool
from inference.engine.request import Admission, FinishReason, Priority, RequestTimings, SamplingParams
from inference.engine.text import TextStream

log = logging.getLogger(__name__)


class AsyncEngine:
    """Runs ``Engine.step`` in one background thread and routes each request's events to its caller.

    Failure policy: if a step raises, the engine's state is unknown (a request may be half-updated),
    so the loop does not go on. Every open stream raises ``EngineFailed`` (its ``__cause__`` is the
    step's exception), ``failed`` turns true, and each later ``submit`` raises the same error at
    once: the owner (worker, CLI) reports it and builds a new engine or exits. ``stop()`` ends every
    open stream with ``EngineStopped`` and cancels its request, so no caller waits forever.
    """

    def __init__(self, engine: Engine, idle_wait_s: float = 0.5) -> None:
        self.engine = engine
        # Every submission, cancel, command and stop wakes the idle loop at once (``_wake``); this bounds
        # only a wait with nothing to do, which at 10 ms cost an idle worker 100 wake-ups a second.
        self._idle_wait_s = idle_wait_s
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[TokenEvent | BaseException]]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failure: EngineFailed | None = None
        self._stopped = False
        # (function of the engine, its future): run on the step thread, between steps.
        self._commands: queue_module.SimpleQueue[tuple[Callable[[Engine], Any], concurrent.futures.Future]] = \
            queue_module.SimpleQueue()

    @property
    def failed(self) -> bool:
        """True once a step has raised; the engine serves nothing more."""
        return self._failure is not None

    @property
    def failure(self) -> EngineFailed | None:
        """The error open and later requests get after a failed step (None while healthy)."""
        return self._failure

    def start(self) -> None:
        if self._stopped:
            raise EngineStopped("this AsyncEngine was stopped; wrap the engine in a new AsyncEngine")
        if self._thread is None:
            # From now on the step thread runs the model: the calling thread's OpenMP team (made
            # while it loaded and packed the weights) would cut the step thread's spin-wait (openmp.py).
            release_thread_pool()
            self._thread = threading.Thread(target=self._run, name="chatpipe-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the step loop; every stream still open ends with ``EngineStopped`` and its request
        is cancelled (its cache is freed at the engine's next step). Blocking: joins the thread."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            self._stopped = True
            open_streams, self._queues = self._queues, {}
        for request_id, target in open_streams.items():
            self.engine.abort(request_id)
            _post(target, EngineStopped(f"request {request_id}: the engine was stopped before it finished"))
        self._fail_commands(lambda: EngineStopped("the engine was stopped before it ran the command"))

    async def __aenter__(self) -> AsyncEngine:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)

    def submit(
        self, prompt_token_ids: Sequence[int], params: SamplingParams = SamplingParams(),
        priority: Priority = Priority.INTERACTIVE, request_id: str | None = None, text_stream: Any = None,
        tenant: str = DEFAULT_TENANT, user_id: str = "", cache_prefix: bool = True, constraint: Any = None,
    ) -> RequestStream:  # fmt: skip
        """Queue a request; look at ``.admission`` (or ``.refusal``) before iterating (a refused
        stream is empty). Raises ``EngineFailed`` / ``EngineStopped`` when the engine is no longer
        serving, ``InvalidRequestError`` for a request it can never run. With a ``text.TextStream``
        each event carries its ``text`` and a stop string ends the request in the step that
        completes it. ``tenant`` salts its prefix-cache hashes, ``user_id`` owns its blocks,
        ``constraint`` restricts its tokens (``Engine.add_request``)."""
        return self.submit_group([request_id], prompt_token_ids, params, priority, [text_stream], tenant=tenant,
                                 user_id=user_id, cache_prefix=cache_prefix, constraints=[constraint])[0]

    def submit_group(
        self, request_ids: Sequence[str] | int, prompt_token_ids: Sequence[int], params: SamplingParams = SamplingParams(),
        priority: Priority = Priority.INTERACTIVE, text_streams: Sequence[Any] | None = None,
        tenant: str = DEFAULT_TENANT, user_id: str = "", cache_prefix: bool = True,
        constraints: Sequence[Any] | None = None, share_weight: float = 1.0, adapter: str | None = None,
    ) -> list[RequestStream]:  # fmt: skip
        """n > 1 answers to one prompt sharing its KV (``Engine.add_request_group``): one stream per
        request id, in order, all accepted or all refused (each refused stream carries the
        refusal). Sibling i gets ``seed + i`` when the params have a seed. ``adapter``: a registered
        LoRA adapter's name (None: the base model)."""
        loop = asyncio.get_running_loop()
        with self._lock:  # registered before the engine can produce their first events
            self._check_serving()
            admission, reqs = self.engine.add_request_group(
                request_ids, prompt_token_ids, params, priority, text_streams, tenant=tenant, user_id=user_id,
                cache_prefix=cache_prefix, constraints=constraints, share_weight=share_weight, adapter=adapter,
            )  # fmt: skip
            streams = [self._stream(loop, admission, req) for req in reqs]
        self._wake.set()
        return streams

    def _check_serving(self) -> None:
        if self._failure is not None:
            raise EngineFailed(str(self._failure)) from self._failure.__cause__
        if self._stopped:
            raise EngineStopped("the engine was stopped; it takes no more requests")

    def _stream(self, loop: asyncio.AbstractEventLoop, admission: Admission, req: Any) -> RequestStream:
        queue: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        if admission is Admission.ACCEPTED:
            self._queues[req.request_id] = (loop, queue)
        refusal = None if admission is Admission.ACCEPTED else self.engine.refusal_error(admission, req)
        return RequestStream(self, req.request_id, admission, queue, refusal)

    def cancel(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()

    async def forget_prefixes(self, tenant: str, user_id: str) -> int:
        """``Engine.forget_prefixes`` run by the step thread before its next step (the engine is
        driven by that one thread); returns the blocks dropped. Raises ``EngineFailed`` /
        ``EngineStopped`` when the engine no longer runs."""
        return await asyncio.wrap_future(self.run_on_engine(lambda engine: engine.forget_prefixes(tenant, user_id)))

    def run_on_engine(self, command: Callable[[Engine], Any]) -> concurrent.futures.Future:
        """Queue ``command(engine)`` for the step thread (between two steps, also when idle)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._failure is not None:
                raise EngineFailed(str(self._failure)) from self._failure.__cause__
            if self._stopped or self._thread is None:
                raise EngineStopped("the engine is not running; it takes no more commands")
            self._commands.put((command, future))
        self._wake.set()
        return future

    def _run_commands(self) -> None:
        while not self._commands.empty():  # one reader at a time: the step thread, or stop() after it
            command, future = self._commands.get_nowait()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(command(self.engine))
            except BaseException as exc:  # noqa: BLE001 - the caller gets it; a command is not a step
                future.set_exception(exc)

    def _fail_commands(self, error: Callable[[], BaseException]) -> None:
        while not self._commands.empty():
            _, future = self._commands.get_nowait()
            if future.set_running_or_notify_cancel():
                future.set_exception(error())

    def _run(self) -> None:
        while not self._stop.is_set():
            self._run_commands()
            if not self.engine.has_work():
                self._wake.wait(self._idle_wait_s)
                self._wake.clear()
                continue
            try:
                events = self.engine.step()
            except BaseException as exc:  # noqa: BLE001 - any failure ends the loop, and callers must hear of it
                self._fail(exc)
                return
            with self._lock:
                targets = [
                    (ev, self._queues.pop(ev.request_id, None) if ev.finished else self._queues.get(ev.request_id))
                    for ev in events
                ]  # fmt: skip
            # One hand-over per event loop per step, not one per event: each wakes the loop's thread,
            # which then takes the GIL from this thread in the middle of the next step.
            by_loop: dict[asyncio.AbstractEventLoop, list[tuple[object, asyncio.Queue]]] = {}
            for ev, target in targets:
                if target is not None:
                    by_loop.setdefault(target[0], []).append((ev, target[1]))
            for loop, items in by_loop.items():
                if not _post_all(loop, items):
                    # The caller's event loop is closed: nobody can read these streams any more.
                    for ev, _ in items:
                        with self._lock:
                            self._queues.pop(ev.request_id, None)
                        self.engine.abort(ev.request_id)

    def _fail(self, exc: BaseException) -> None:
        message = f"the engine's step loop failed ({type(exc).__name__}: {exc}); build a new engine to go on"
        log.error("%s", message, exc_info=exc)
        with self._lock:
            self._failure = EngineFailed(message)
            self._failure.__cause__ = exc
            open_streams, self._queues = self._queues, {}
        self._fail_commands(lambda: EngineFailed(message))
        for target in open_streams.values():
            error = EngineFailed(message)  # one instance per stream: each gets its own traceback
            error.__cause__ = exc
            _post(target, error)


def _post_all(loop: asyncio.AbstractEventLoop, items: list[tuple[object, asyncio.Queue]]) -> bool:
    """Hand items to their streams' queues on ``loop`` from any thread, in one call (a step's events:
    one wake-up of the loop's thread); False if the loop is closed."""
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:  # "Event loop is closed"
        return False
    return True


def _put_all(items: list[tuple[object, asyncio.Queue]]) -> None:
    for item, queue in items:
        queue.put_nowait(item)


def _post(target: tuple[asyncio.AbstractEventLoop, asyncio.Queue], item: object) -> bool:
    """Hand ``item`` to a stream's queue from any thread; False if its event loop is closed."""
    loop, queue = target
    return _post_all(loop, [(item, queue)])


class RequestStream:
    """Async iterator of one request's ``TokenEvent``s; the last one has ``finished=True``.

    Raises ``EngineFailed`` or ``EngineStopped`` instead of the last event when the engine failed
    or was stopped first. ``refusal`` is the ``RequestRefused`` error of a refused request (None
    when accepted), ready to raise or to report.
    """

    def __init__(
        self, owner: AsyncEngine, request_id: str, admission: Admission, queue: asyncio.Queue,
        refusal: RequestRefused | None = None,
    ) -> None:  # fmt: skip
        self.owner = owner
        self.request_id = request_id
        self.admission = admission
        self.refusal = refusal
        self._queue = queue
        self._done = admission is not Admission.ACCEPTED

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[TokenEvent]:
        try:
            while not self._done:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    self._done = True  # the engine already dropped this request
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
    num_cached_tokens: int = 0  # final one: prompt tokens taken from the prefix cache (Request.num_cached_tokens)


async def stream_text(
    aengine: AsyncEngine, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams = SamplingParams(),
    stop: Sequence[str] = (), priority: Priority = Priority.INTERACTIVE, constraint: Any = None,
) -> AsyncIterator[TextDelta]:  # fmt: skip
    """Text increments of one generation; a stop string ends it (reason STOP) and is not shown.
    The deltas joined equal the decoded output (up to the stop string).

    Raises ``RequestRefused`` (with the prompt's token count and the limit) when the engine refuses
    the request, ``InvalidRequestError`` for a request it can never run, ``EngineFailed`` /
    ``EngineStopped`` when the engine fails or stops before the end."""
    text_stream = TextStream(tokenizer, stop)
    stream = aengine.submit(prompt_token_ids, params, priority, text_stream=text_stream, constraint=constraint)
    if stream.refusal is not None:
        raise stream.refusal
    events = stream.__aiter__()
    try:
        async for ev in events:
            # The engine's step built the text and ended the request at the token completing a stop string.
            text = ev.text or ""
            if ev.finished:
                yield TextDelta(text, True, ev.finish_reason, ev.timings, ev.num_prompt_tokens, ev.num_output_tokens,
                                ev.num_cached_tokens)
                return
            if text:
                yield TextDelta(text)
    finally:
        await events.aclose()
