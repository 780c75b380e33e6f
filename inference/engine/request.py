"""A generation request and the plain values around it: sampling parameters, priority, status,
finish reason, admission result, timings.

Pure Python (no torch), shared by the scheduler, the sampler and the engine. It holds token ids
only; text, stop strings and chat templates live at the edge (``text.py``).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from inference.engine.block_allocator import DEFAULT_TENANT, Owner
from inference.engine.errors import InvalidRequestError


class Priority(enum.IntEnum):
    """Queue class; lower runs first. When the KV cache runs out, the lowest class (then the most
    recently admitted request) is preempted first; a new arrival never preempts anyone."""

    INTERACTIVE = 0
    BATCH = 1


class Admission(enum.Enum):
    """What ``add_request`` answers. Refusals are results, not exceptions: the caller turns them
    into a 429 / a dead letter with this reason."""

    ACCEPTED = "accepted"
    OVERLOADED = "overloaded"  # the waiting queue is full; retry later
    TOO_LARGE = "too_large"  # prompt + max_new_tokens can never fit (max_seq_len or the whole KV budget)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # a stop token id was sampled (or a stop string matched, at the text edge)
    LENGTH = "length"  # max_new_tokens or max_seq_len reached
    ABORTED = "aborted"  # cancelled by the caller
    ERROR = "error"  # the engine could not go on with this request (``Request.error`` says why)


def checked_group(request_ids: Sequence[str] | int, prompt_token_ids: Sequence[int], vocab_size: int, *,
                  text_streams: Sequence[Any] | None = None, constraints: Sequence[Any] | None = None,
                  share_weight: float = 1.0) -> tuple[list[str | None], list[int]]:
    """The ids (None where ``request_ids`` is a count: the engine names them) and the prompt as ints
    of a request group an engine may add (``Engine.add_request_group``, the vLLM engine's); raises
    ``InvalidRequestError`` naming what is wrong: no request, a per-request list of another length,
    a share weight that is not a positive number, a token id outside the vocabulary."""
    ids: list[str | None] = [None] * request_ids if isinstance(request_ids, int) else list(request_ids)
    n = len(ids)
    if n < 1:
        raise InvalidRequestError("a request group needs at least one request id")
    for name, per in (("text_streams", text_streams), ("constraints", constraints)):
        if per is not None and len(per) != n:
            raise InvalidRequestError(f"{name} has {len(per)} entries for {n} requests")
    if not (math.isfinite(share_weight) and share_weight > 0):
        raise InvalidRequestError(f"share_weight must be a finite number above 0, got {share_weight}")
    prompt = [int(t) for t in prompt_token_ids]
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    return ids, prompt


MAX_LOGPROBS = 20  # most alternatives per position ``logprobs`` may ask for (OpenAI's top_logprobs bound)
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| bound (OpenAI's)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. ``temperature == 0`` means greedy (argmax), and then top-p/top-k/seed
    are ignored. ``seed`` makes sampling reproducible: same seed, same logits -> same tokens.

    Penalties follow OpenAI: before temperature, the logit of every token that occurs ``c > 0``
    times in this request's *output so far* is lowered by ``frequency_penalty * c +
    presence_penalty`` (prompt tokens do not count). They apply to greedy requests too.
    ``logprobs``: None = none; 0 = the chosen token's log-probability; k in 1..20 = that plus the k
    most likely tokens. They are the log-softmax of the model's raw logits (before penalties,
    temperature and a constraint's mask), vLLM's default."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False  # True: the model's end-of-sequence ids do not stop this request (benchmarks)
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    logprobs: int | None = None  # None, 0 (the chosen token's), or 1..MAX_LOGPROBS alternatives too

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0, got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:  # also refuses NaN
                raise InvalidRequestError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
        lp = self.logprobs
        if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_LOGPROBS):
            raise InvalidRequestError(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {lp!r}")

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class RequestTimings:
    """Monotonic clock readings in seconds; None until the event happened."""

    arrival: float
    admitted: float | None = None  # left the waiting queue, got its KV reservation
    first_token: float | None = None
    finished: float | None = None

    @property
    def queue_time(self) -> float | None:
        return None if self.admitted is None else self.admitted - self.arrival

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival (queue time included)."""
        return None if self.first_token is None else self.first_token - self.arrival

    def tpot(self, num_output_tokens: int) -> float | None:
        """Mean time per output token after the first one."""
        if self.first_token is None or self.finished is None or num_output_tokens < 2:
            return None
        return (self.finished - self.first_token) / (num_output_tokens - 1)


@dataclass(eq=False)
class Request:
    """One generation: the prompt, what is computed so far, and what is wanted.

    vLLM-v1 style, there are no prefill/decode phases: the request *wants* ``num_tokens`` tokens in
    the KV cache and *has* ``num_computed_tokens``; a step computes some of the difference.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: Priority = Priority.INTERACTIVE
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    timings: RequestTimings = field(default_factory=lambda: RequestTimings(arrival=0.0))
    admit_seq: int | None = None  # order of first admission; kept across preemptions (victim order)
    num_preemptions: int = 0
    # Prompt tokens taken from the prefix cache at its first admission: what the caller reports as
    # OpenAI's usage.prompt_tokens_details.cached_tokens. Not overwritten when a preempted request is
    # admitted again: that hit is the engine recomputing its own work (its prompt and output so far,
    # often its own blocks), not the prompt being served from the cache; reported, it could even
    # exceed the prompt.
    num_cached_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # hash chain of its full blocks (allocator)
    # Whose request it is: the tenant salts its prefix hashes (its blocks serve only that tenant),
    # the (tenant, user_id) pair owns the blocks it computes (``Engine.forget_prefixes``).
    tenant: str = DEFAULT_TENANT
    user_id: str = ""
    # The tenant's weight in the fair share (fair_queue.py): twice the weight, twice the tokens when
    # tenants compete. ``num_charged``: prompt positions already counted to the tenant (a recompute
    # after preemption is not charged again).
    share_weight: float = 1.0
    num_charged: int = 0
    register_blocks: bool = True  # False once its user was forgotten: computes, caches nothing more
    num_cross_tenant_cached_tokens: int = 0  # from blocks of other tenants at its last admission (unsalted only)
    # Text edge (``text.TextStream``): fed each sampled token in the engine's step; when it reports
    # a stop string the request ends in that same step. None = token ids only.
    text_stream: Any = None
    # Token constraint (an ``xgrammar.GrammarMatcher`` or anything with its ``fill_next_token_bitmask``,
    # ``accept_token`` and ``is_terminated``): the sampler masks the tokens it forbids and feeds it
    # each sampled token; the request ends (STOP) when it terminates. Stateful, hence not a param.
    constraint: Any = None
    # n > 1 (``Engine.add_request_group``): a sibling is admitted only once this request's prompt
    # is computed, so it takes the prompt's full blocks from the prefix cache. None = no wait.
    prompt_leader: Request | None = None
    error: str | None = None  # why it ended with FinishReason.ERROR
    # The LoRA adapter it runs with (``adapters.Registration``, the engine's handle), None = the base
    # model. Its key joins the prefix-cache hashes; the request waits in the queue until it is in memory.
    adapter: Any = None

    @property
    def owner(self) -> Owner:
        return (self.tenant, self.user_id)

    @property
    def adapter_key(self) -> str | None:
        return None if self.adapter is None else self.adapter.key

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        """Worst-case KV footprint in tokens (reserved at admission only in ``reserve`` mode)."""
        return len(self.prompt_token_ids) + self.params.max_new_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]
