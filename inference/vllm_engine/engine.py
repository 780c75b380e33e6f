"""vLLM's v1 engine behind the surface of ``inference.engine.Engine`` that ``AsyncEngine`` and the
worker drive: ``add_request_group`` / ``abort`` / ``has_work`` / ``step`` -> ``TokenEvent``s,
``stats``, ``forget_prefixes``, ``refusal_error``.

Why ``LLMEngine`` in process, stepped by ``AsyncEngine``'s thread, and not ``AsyncLLM``: the worker's
whole contract (one step thread, one event queue per request, cancel at the next step, a failed step
fails every open stream, stop ends them with ``EngineStopped``) is ``AsyncEngine``'s, tested once for
both engines. ``AsyncLLM`` would add a second process and a second event loop to reason about.
vLLM's ``LLMEngine`` is not thread-safe, so requests and aborts coming from the worker's event loop are
queued here (under a lock) and handed to vLLM by the step thread at the start of its next step.

What maps, and how (docs/worker.md, "Engines"):
- text and stop strings: vLLM returns token ids only (``detokenize=False``); each request's
  ``text.TextStream`` (the same text edge as our engine's) builds the text and a completed stop string
  aborts the request in vLLM in that same step, so both engines answer the same text for the same ids;
- priorities: ``scheduling_policy="priority"`` with our ``Priority`` values (lower runs first);
- the tenant salt of the prefix cache: vLLM's per-request ``cache_salt`` (the tenant); a request whose
  user has a Deletion since (``cache_prefix=False``) gets a salt of its own, so nothing it computes is
  found again;
- ``forget_prefixes``: vLLM cannot drop one user's blocks, so the whole prefix cache is reset (every
  block no running request holds); the count returned is therefore not known and reported as 0;
- structured outputs and tool calls: the constraint is a ``StructuredOutputsParams`` built by
  ``constraints.py`` (the same grammar ours compiles, as EBNF, to vLLM's xgrammar backend);
- logprobs / top_logprobs, penalties, seed (sibling i: seed + i, as ours), max tokens, stop token
  ids, ``n`` (one vLLM request per choice, sharing the prompt through the prefix cache);
- LoRA adapters: not mapped yet: a request naming one is refused with the reason
  (``InvalidRequestError``); versions are still followed and checked, so a worker never crashes on one.
Admission: TOO_LARGE when prompt + max tokens exceed the context; OVERLOADED when more than
``max_waiting`` requests wait (vLLM queues without bound).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from inference.engine.block_allocator import DEFAULT_TENANT
from inference.engine.engine import EngineStats, TokenEvent
from inference.engine.errors import InvalidRequestError, RequestRefused
from inference.engine.request import Admission, FinishReason, Priority, RequestTimings, SamplingParams, checked_group
from inference.engine.settings import EngineSettings
from inference.engine.throughput import StepCounts

log = logging.getLogger(__name__)

FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORTED,
          "error": FinishReason.ERROR}


@dataclass(eq=False)
class VllmRequest:
    """One request as this adapter follows it (vLLM keeps its own state)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    text_stream: Any
    timings: RequestTimings
    output_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    started: bool = False  # vLLM has produced its first token


@dataclass(frozen=True)
class _Submission:
    request: VllmRequest
    prompt: dict
    params: Any  # vllm.SamplingParams
    priority: int


def kv_cache_bytes(model_config: Any, tokens: int, dtype_bytes: int) -> int:
    """The bytes of a KV cache holding ``tokens`` tokens of this model (K and V, every layer)."""
    heads = getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    return tokens * model_config.num_hidden_layers * 2 * heads * head_dim * dtype_bytes


class VllmEngine:
    def __init__(self, model_dir: Path, settings: EngineSettings) -> None:
        from transformers import AutoConfig, GenerationConfig
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        self.settings = settings
        self.model_dir = Path(model_dir)
        config = AutoConfig.from_pretrained(self.model_dir, local_files_only=True)
        self.vocab_size = int(config.vocab_size)
        self.max_seq_len = min(settings.max_seq_len, getattr(config, "max_position_embeddings", settings.max_seq_len))
        self.eos_token_ids = _eos_ids(self.model_dir, config, GenerationConfig)
        dtype = settings.resolved_dtype()
        # vLLM's CPU attention takes blocks of a multiple of 32 tokens (our default is 16); on a GPU ours as it is
        self.block_size = settings.kv_block_size if settings.resolved_device().startswith("cuda") \
            else -(-settings.kv_block_size // 32) * 32
        dtype_bytes = 4 if dtype == "float32" else 2
        args = EngineArgs(
            model=str(self.model_dir), dtype=dtype, seed=0, max_model_len=self.max_seq_len,
            max_num_seqs=settings.max_batch, max_num_batched_tokens=max(settings.max_step_tokens, self.max_seq_len),
            block_size=self.block_size,
            kv_cache_memory_bytes=kv_cache_bytes(config, settings.kv_cache_tokens, dtype_bytes),
            enable_prefix_caching=settings.prefix_caching, scheduling_policy="priority",
            # eager: vLLM's compile cache does not reload on CPU, and compiling takes 1.5-3 min a start
            enforce_eager=True, disable_log_stats=False,
        )  # fmt: skip
        self.llm = LLMEngine.from_engine_args(args)
        self._lock = threading.Lock()
        self._submissions: list[_Submission] = []
        self._aborts: list[str] = []
        self._siblings: dict[str, list[_Submission]] = {}  # a group's first request id -> the others, not yet in vLLM
        self._live: dict[str, VllmRequest] = {}
        self._waiting = 0  # accepted, no first token yet
        self._hit_tokens = self._queried_tokens = 0
        self._counts = StepCounts()

    # -- the surface AsyncEngine drives (called with its lock held, from the event loop) ---------

    def add_request_group(
        self, request_ids: Sequence[str] | int, prompt_token_ids: Sequence[int],
        params: SamplingParams = SamplingParams(), priority: Priority = Priority.INTERACTIVE,
        text_streams: Sequence[Any] | None = None, tenant: str = DEFAULT_TENANT, user_id: str = "",
        cache_prefix: bool = True, constraints: Sequence[Any] | None = None, share_weight: float = 1.0,
        adapter: str | None = None,
    ) -> tuple[Admission, list[VllmRequest]]:  # fmt: skip
        """As ``Engine.add_request_group``; the requests reach vLLM at the start of the next step."""
        named, prompt = checked_group(request_ids, prompt_token_ids, self.vocab_size, text_streams=text_streams,
                                      constraints=constraints, share_weight=share_weight)
        ids = [rid or f"req-{uuid.uuid4().hex[:12]}" for rid in named]
        n = len(ids)
        if adapter is not None:
            raise InvalidRequestError(f"model version {adapter!r}: the vLLM engine does not serve LoRA adapters yet; "
                                      "serve fine-tuned versions with --engine chatpipe")
        now = time.monotonic()
        reqs = [VllmRequest(rid, prompt, params, text_streams[i] if text_streams else None, RequestTimings(now))
                for i, rid in enumerate(ids)]
        if len(prompt) + params.max_new_tokens > self.max_seq_len:
            return Admission.TOO_LARGE, reqs
        if self._waiting >= self.settings.max_waiting + self.settings.max_batch:
            return Admission.OVERLOADED, reqs
        salt = tenant if self.settings.prefix_cache_salt else None
        if not cache_prefix:  # the user's Deletion came after this request was made: share nothing
            salt = f"{tenant}/{uuid.uuid4().hex}"
        made = [_Submission(req, _prompt(prompt, salt), self._vllm_params(params, i, constraints), int(priority))
                for i, req in enumerate(reqs)]
        with self._lock:
            # The siblings wait for the first one's first token: its prompt blocks are cached by then,
            # so they take them from the prefix cache instead of computing the prompt again (as ours do).
            self._submissions.append(made[0])
            if len(made) > 1 and self.settings.prefix_caching:
                self._siblings[reqs[0].request_id] = made[1:]
            else:
                self._submissions += made[1:]
            for req in reqs:
                self._live[req.request_id] = req
            self._waiting += n
        return Admission.ACCEPTED, reqs

    def refusal_error(self, admission: Admission, request: VllmRequest) -> RequestRefused:
        limit = self.settings.max_waiting if admission is Admission.OVERLOADED else self.max_seq_len
        return RequestRefused(admission, len(request.prompt_token_ids), request.params.max_new_tokens, limit)

    def abort(self, request_id: str) -> bool:
        """Cancel a request; it ends (ABORTED) at the next step, which also tells vLLM."""
        with self._lock:
            if request_id not in self._live:
                return False
            self._aborts.append(request_id)
            return True

    def has_work(self) -> bool:
        with self._lock:
            if self._submissions or self._aborts:
                return True
        return self.llm.has_unfinished_requests()

    def forget_prefixes(self, tenant: str, user_id: str) -> int:
        """vLLM cannot drop one user's blocks: every cached block no running request holds is dropped
        (``reset_prefix_cache``); the count is not known (0). Runs on the step thread."""
        self.llm.reset_prefix_cache()
        return 0

    # -- model versions (followed and checked; not served: see the module docstring) -------------

    def check_adapter(self, folder: Any) -> None:
        from inference.engine.lora import read_adapter_config

        read_adapter_config(Path(folder))

    def register_adapter(self, name: str, folder: Any) -> str:
        return name

    def retire_adapter(self, name: str) -> bool:
        return True

    # -- the step (AsyncEngine's thread only) -----------------------------------------------------

    def step(self) -> list[TokenEvent]:
        started = time.monotonic()
        with self._lock:
            submissions, self._submissions = self._submissions, []
            aborts, self._aborts = self._aborts, []
            for leader, held in list(self._siblings.items()):  # a cancelled sibling never reaches vLLM
                self._siblings[leader] = [sub for sub in held if sub.request.request_id not in aborts]
        events: list[TokenEvent] = []
        for sub in submissions:
            if sub.request.request_id in aborts:  # cancelled before vLLM saw it
                continue
            self.llm.add_request(sub.request.request_id, sub.prompt, sub.params, priority=sub.priority)
        ended = [rid for rid in dict.fromkeys(aborts) if rid in self._live]
        if ended:
            self.llm.abort_request(ended)
            events += [self._finish(self._live[rid], FinishReason.ABORTED, None, None) for rid in ended]
        if not self.llm.has_unfinished_requests():
            return events
        generated = prompt_tokens = 0
        for out in self.llm.step():
            req = self._live.get(out.request_id)
            if req is None:  # ended by us (a stop string, an abort) after vLLM produced it
                continue
            if not req.started:
                self._release_siblings(req.request_id)
                req.started = True
                req.timings.admitted = req.timings.first_token = time.monotonic()
                req.num_cached_tokens = out.num_cached_tokens or 0
                prompt_tokens += len(req.prompt_token_ids) - req.num_cached_tokens
                self._hit_tokens += req.num_cached_tokens
                self._queried_tokens += len(req.prompt_token_ids)
                with self._lock:
                    self._waiting -= 1
            completion = out.outputs[0]
            new = list(completion.token_ids)
            generated += len(new)
            events += self._token_events(req, new, completion.logprobs, out.finished, completion.finish_reason)
        self._count(prompt_tokens, generated, started)
        return events

    def _token_events(self, req: VllmRequest, tokens: list[int], logprobs: Any, finished: bool,
                      reason: str | None) -> list[TokenEvent]:
        events = []
        for j, token in enumerate(tokens):
            req.output_token_ids.append(token)
            lp, top = _logprob_of(logprobs, j, token, req.params.logprobs)
            text = req.text_stream.push(token) if req.text_stream is not None else None
            stopped = req.text_stream is not None and req.text_stream.stopped
            last = j == len(tokens) - 1
            if stopped or (last and finished):
                if stopped and not (last and finished):
                    self.llm.abort_request([req.request_id])
                why = FinishReason.STOP if stopped else FINISH.get(reason or "stop", FinishReason.STOP)
                events.append(self._finish(req, why, token, text, lp, top))
                return events
            events.append(TokenEvent(req.request_id, token, finished=False, text=text, logprob=lp, top_logprobs=top))
        if finished:  # vLLM ended it with no new token (an abort of its own)
            events.append(self._finish(req, FINISH.get(reason or "abort", FinishReason.ABORTED), None, None))
        return events

    def _release_siblings(self, leader_id: str) -> None:
        with self._lock:
            self._submissions += self._siblings.pop(leader_id, [])

    def _finish(self, req: VllmRequest, reason: FinishReason, token: int | None, text: str | None,
                logprob: float | None = None, top: tuple[tuple[int, float], ...] | None = None) -> TokenEvent:
        self._release_siblings(req.request_id)  # a first request that ended before its first token
        with self._lock:
            self._live.pop(req.request_id, None)
            if not req.started:
                self._waiting -= 1
        if req.text_stream is not None:
            tail = req.text_stream.finish()
            if reason is not FinishReason.STOP and req.text_stream.stopped:
                reason = FinishReason.STOP  # the held-back tail completed a stop string
            text = (text or "") + tail
        req.timings.finished = time.monotonic()
        return TokenEvent(req.request_id, token, finished=True, finish_reason=reason,
                          timings=dataclasses.replace(req.timings), num_prompt_tokens=len(req.prompt_token_ids),
                          num_output_tokens=len(req.output_token_ids), text=text, logprob=logprob, top_logprobs=top,
                          num_cached_tokens=req.num_cached_tokens)  # fmt: skip

    def _vllm_params(self, params: SamplingParams, index: int, constraints: Sequence[Any] | None) -> Any:
        from vllm import SamplingParams as VllmSampling
        from vllm.sampling_params import RequestOutputKind

        seed = params.seed + index if params.seed is not None else None
        return VllmSampling(
            max_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
            top_k=params.top_k, seed=seed, presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty, logprobs=params.logprobs, ignore_eos=params.ignore_eos,
            stop_token_ids=sorted(params.stop_token_ids) or None, detokenize=False,
            output_kind=RequestOutputKind.DELTA,
            structured_outputs=constraints[index] if constraints else None,
        )  # fmt: skip

    # -- load reports ----------------------------------------------------------------------------

    def _count(self, prompt_tokens: int, generated: int, started: float) -> None:
        now = time.monotonic()
        running = len(self._live) - self._waiting
        saturated = self._waiting > 0 or running >= self.settings.max_batch
        self._counts.record(now, now - started, prompt_tokens, generated, saturated)

    def stats(self) -> EngineStats:
        now = time.monotonic()
        counts = self._counts
        with self._lock:
            live = list(self._live.values())
            waiting = self._waiting  # accepted, no first token yet (queued here or in vLLM)
        running = [r for r in live if r.started]
        usage = _kv_usage(self.llm)
        capacity = self.settings.kv_cache_tokens
        block = self.block_size
        decode_rate, prefill_rate = counts.throughput.rates(now)
        used_tokens = int(usage * capacity)
        return EngineStats(
            running=len(running), waiting=waiting, kv_used_tokens=used_tokens, kv_capacity_tokens=capacity,
            kv_block_size=block, kv_in_use_blocks=used_tokens // block, kv_cached_blocks=0, kv_evictable_blocks=0,
            kv_free_blocks=(capacity - used_tokens) // block, prefix_cache_hit_tokens=self._hit_tokens,
            preemptions=0, steps=counts.steps, prompt_tokens=counts.prompt_tokens, generated_tokens=counts.generated,
            tokens_per_s=counts.tokens_per_s(now),
            prefix_cache_queried_tokens=self._queried_tokens, max_running=self.settings.max_batch,
            queued_prompt_tokens=sum(len(r.prompt_token_ids) for r in live if not r.started),
            queued_output_tokens=sum(r.params.max_new_tokens for r in live if not r.started),
            running_output_tokens=sum(max(0, r.params.max_new_tokens - len(r.output_token_ids)) for r in running),
            decode_tokens_per_s=decode_rate, prefill_tokens_per_s=prefill_rate,
        )  # fmt: skip

    def shutdown(self) -> None:
        """Free vLLM's engine (its executor and KV cache)."""
        core = getattr(self.llm, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()


def _prompt(ids: list[int], salt: str | None) -> dict:
    prompt: dict = {"prompt_token_ids": ids}
    if salt is not None:
        prompt["cache_salt"] = salt
    return prompt


def _logprob_of(logprobs: Any, j: int, token: int, wanted: int | None
                ) -> tuple[float | None, tuple[tuple[int, float], ...] | None]:
    """(the token's logprob, the ``wanted`` most likely (id, logprob) best first) of position ``j``
    of vLLM's per-step logprobs (a dict per position, the sampled token always in it)."""
    if wanted is None or not logprobs or j >= len(logprobs):
        return None, None
    at = logprobs[j]
    chosen = at.get(token)
    top = sorted(((tid, lp) for tid, lp in at.items() if lp.rank is not None and lp.rank <= wanted),
                 key=lambda item: item[1].rank)
    return (float(chosen.logprob) if chosen is not None else None,
            tuple((int(tid), float(lp.logprob)) for tid, lp in top) if wanted else None)


def _kv_usage(llm: Any) -> float:
    """The fraction of vLLM's KV cache in use (its scheduler's own figure; 0 when not reachable)."""
    core = getattr(getattr(llm, "engine_core", None), "engine_core", None)
    manager = getattr(getattr(core, "scheduler", None), "kv_cache_manager", None)
    try:
        return float(manager.usage) if manager is not None else 0.0
    except Exception:  # noqa: BLE001 - a load figure only; vLLM's internals may move
        return 0.0


def _eos_ids(model_dir: Path, config: Any, generation_config_cls: Any) -> frozenset[int]:
    try:
        eos = generation_config_cls.from_pretrained(model_dir, local_files_only=True).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    return frozenset([eos] if isinstance(eos, int) else eos or ())
