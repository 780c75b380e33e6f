"""The engine: continuous batching of token-id requests over one model, one step at a time.

Each ``step()`` asks the scheduler what to compute, runs one ragged forward (``model_runner``),
samples the next token of every request whose prompt is fully in the cache, and reports
``TokenEvent``s. Requests join and leave the running batch at every step.

The engine knows token ids only: no tokenizer, no chat template, no threads or asyncio
(``streaming.py`` runs it in a thread; ``text.py`` holds the text edge). A request may carry a
``text.TextStream``: the step feeds it each sampled token and ends the request in that same step
when a stop string completes (a caller cancelling from its own thread would be a step late).
A request may also carry a token constraint (``Request.constraint``, an xgrammar ``GrammarMatcher``):
the sampler masks what it forbids, and the request ends (STOP) once the constraint terminates.
``add_request_group`` adds the n > 1 siblings of one prompt, which share its KV blocks.
A request may name a LoRA adapter registered with ``register_adapter`` (``adapters.py``: loading
beside the step loop, at most ``max_loras`` in memory); one step mixes rows of any adapters and of
the base model (``lora_bank.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from inference.engine.adapters import AdapterSlots, AdapterStats
from inference.engine.block_allocator import DEFAULT_TENANT, BlockAllocator
from inference.engine.errors import RequestRefused
from inference.engine.kv_cache import PagedKVCache
from inference.engine.lora import load_adapter
from inference.engine.model_runner import ModelRunner, check_supported
from inference.engine.request import (Admission, FinishReason, Priority, Request, RequestTimings, SamplingParams,
                                      checked_group)
from inference.engine.sampling import Sampler
from inference.engine.scheduler import Scheduler, SchedulerConfig
from inference.engine.settings import EngineSettings
from inference.engine.throughput import StepCounts


@dataclass(frozen=True)
class TokenEvent:
    request_id: str
    token_id: int | None  # None when the request ended without a new token (cancelled)
    finished: bool
    finish_reason: FinishReason | None = None
    timings: RequestTimings | None = None  # set on the finishing event
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    text: str | None = None  # text safe to show after this token (requests with a text_stream only)
    # params.logprobs is not None: the token's log-probability and the params.logprobs most likely
    # (token id, logprob), best first; log_softmax of the raw logits (before penalties, temperature
    # and a constraint's mask).
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    error: str | None = None  # finish_reason ERROR: why
    num_cached_tokens: int = 0  # finishing event: prompt tokens its first admission took from the prefix cache


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_used_tokens: int  # held by requests, in whole blocks
    kv_capacity_tokens: int
    kv_block_size: int
    kv_in_use_blocks: int  # held by running requests (a shared prefix block counts once)
    kv_cached_blocks: int  # full blocks registered in the prefix cache (in use or evictable)
    kv_evictable_blocks: int  # cached blocks no request holds: reusable, evicted LRU when space is needed
    kv_free_blocks: int  # neither held nor cached
    prefix_cache_hit_tokens: int  # prompt tokens taken from the prefix cache since start
    preemptions: int  # running requests sent back to the queue since start (for KV blocks, or fairness below)
    steps: int
    prompt_tokens: int  # prompt tokens computed (prefilled) since start
    generated_tokens: int  # sampled since start
    tokens_per_s: float  # generated tokens per second over the last few seconds
    prefix_cache_cross_tenant_hit_tokens: int = 0  # hits on other tenants' blocks: 0 unless the salt is off
    prefix_cache_forgotten_blocks: int = 0  # dropped by forget_prefixes since start
    prefix_cache_queried_tokens: int = 0  # prompt tokens of the admissions that looked the cache up since start
    max_running: int = 0  # the batch: most requests running at once
    queued_prompt_tokens: int = 0  # the work waiting, in tokens (scheduler.QueueLoad)
    queued_output_tokens: int = 0
    running_output_tokens: int = 0
    decode_tokens_per_s: float = 0.0  # measured while saturated (throughput.py): what the engine can do
    prefill_tokens_per_s: float = 0.0
    fairness_preemptions: int = 0  # of preemptions: to give a tenant under its share a slot (fair_queue.py)
    priority_preemptions: int = 0  # of preemptions: a batch request making way for an interactive one (scheduler.py)

    @property
    def kv_usage(self) -> float:
        return self.kv_used_tokens / self.kv_capacity_tokens


def eos_token_ids(model: Any) -> frozenset[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    return frozenset([eos] if isinstance(eos, int) else eos or ())  # None: the model names no EOS


class Engine:
    def __init__(self, model: Any, settings: EngineSettings) -> None:
        cfg = model.config
        check_supported(cfg, settings.max_seq_len)
        if settings.num_threads:
            torch.set_num_threads(settings.num_threads)
        self.model = model
        self.settings = settings
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = eos_token_ids(model)
        param = next(model.parameters())
        num_blocks = max(1, settings.kv_cache_tokens // settings.kv_block_size)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.allocator = BlockAllocator(num_blocks, settings.kv_block_size, prefix_caching=settings.prefix_caching,
                                        salt=settings.prefix_cache_salt)
        self.cache = PagedKVCache(
            cfg.num_hidden_layers, num_blocks, settings.kv_block_size, cfg.num_key_value_heads, head_dim,
            dtype=param.dtype, device=param.device,
        )  # fmt: skip
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_batch=settings.max_batch,
                max_seq_len=min(settings.max_seq_len, getattr(cfg, "max_position_embeddings", settings.max_seq_len)),
                max_step_tokens=settings.max_step_tokens,
                max_waiting=settings.max_waiting,
                queue_policy=settings.queue_policy,
                kv_allocation=settings.kv_allocation,
            ),
            self.allocator,
            adapter_ready=lambda reg: self.adapters.ensure(reg),
        )
        self.adapters = AdapterSlots(
            loader=lambda name, folder: load_adapter(name, folder, cfg, param.dtype, param.device,
                                                     settings.max_lora_rank),
            num_layers=cfg.num_hidden_layers, max_loras=settings.max_loras,
        )  # fmt: skip
        packed = settings.resolved_packed_linear(param.device, param.dtype)
        self.runner = ModelRunner(model, self.cache, compile=settings.compile,
                                  lean=settings.resolved_lean_layers(param.device.type, packed),
                                  paged_kernel=settings.resolved_paged_kernel(param.device.type, str(param.dtype).removeprefix("torch.")),
                                  packed_linear=packed, batch_hint=settings.max_batch)
        self.sampler = Sampler(param.device)
        self._ids = itertools.count()
        self._counts = StepCounts()

    # -- callers ---------------------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams = SamplingParams(),
        priority: Priority = Priority.INTERACTIVE,
        request_id: str | None = None,
        text_stream: Any = None,
        tenant: str = DEFAULT_TENANT,
        user_id: str = "",
        cache_prefix: bool = True,
        constraint: Any = None,
        adapter: str | None = None,
    ) -> tuple[Admission, Request]:
        """Queue a request. Refusals (OVERLOADED, TOO_LARGE) come back as the Admission result
        (``refusal_error`` turns one into an error); a request that can never run raises
        ``InvalidRequestError``. ``text_stream`` (a ``text.TextStream``) makes the step produce the
        request's text and end it at the step whose token completes a stop string. ``tenant``
        salts its prefix-cache hashes (only that tenant's requests share its blocks); ``user_id``
        is whose blocks they are, for ``forget_prefixes``; ``cache_prefix=False`` reads the cache
        but registers none of its blocks (a request its user's deletion already covers).
        ``constraint`` (an ``xgrammar.GrammarMatcher`` built for this model's vocabulary, fresh for
        this request) restricts each sampled token to what it allows; the request ends with STOP
        when it terminates (it accepted its stop token). ``adapter``: the name of a registered LoRA
        adapter to run with (None: the base model); the request waits in the queue while it loads."""
        admission, reqs = self.add_request_group([request_id], prompt_token_ids, params, priority, [text_stream],
                                                 tenant, user_id, cache_prefix, [constraint],
                                                 adapter=adapter)  # fmt: skip
        return admission, reqs[0]

    def add_request_group(
        self,
        request_ids: Sequence[str] | int,
        prompt_token_ids: Sequence[int],
        params: SamplingParams = SamplingParams(),
        priority: Priority = Priority.INTERACTIVE,
        text_streams: Sequence[Any] | None = None,
        tenant: str = DEFAULT_TENANT,
        user_id: str = "",
        cache_prefix: bool = True,
        constraints: Sequence[Any] | None = None,
        share_weight: float = 1.0,
        adapter: str | None = None,
    ) -> tuple[Admission, list[Request]]:
        """n > 1: one request per id in ``request_ids`` (or ``n`` with generated ids) on the same
        prompt, all accepted or all refused. The first computes the prompt; the others are
        admitted only once it has (the step after its first token), so they take the prompt's
        full blocks from the prefix cache instead of computing them again (with prefix caching
        off they run at once). With a seed, sibling i gets ``seed + i``, so the n answers differ and
        each is reproducible. ``text_streams`` / ``constraints``: one per sibling (each its own
        object: both are stateful), or None. ``share_weight``: the tenant's weight in the fair share
        (``fair_queue.py``). ``adapter``: as for ``add_request``, for every sibling."""
        ids, prompt = checked_group(request_ids, prompt_token_ids, self.vocab_size, text_streams=text_streams,
                                    constraints=constraints, share_weight=share_weight)
        n = len(ids)
        if not params.ignore_eos:
            params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids | self.eos_token_ids)
        regs = [self.adapters.acquire(adapter) for _ in ids] if adapter is not None else [None] * n
        reqs: list[Request] = []
        for i, rid in enumerate(ids):
            p = params if params.seed is None or i == 0 else dataclasses.replace(params, seed=params.seed + i)
            reqs.append(Request(
                request_id=rid if rid is not None else f"req-{next(self._ids)}",
                prompt_token_ids=list(prompt),
                params=p,
                priority=priority,
                text_stream=text_streams[i] if text_streams else None,
                tenant=tenant,
                user_id=user_id,
                share_weight=share_weight,
                register_blocks=cache_prefix,
                constraint=constraints[i] if constraints else None,
                prompt_leader=reqs[0] if reqs else None,
                adapter=regs[i],
            ))  # fmt: skip
        admission = self.scheduler.add_group(reqs)
        if admission is not Admission.ACCEPTED:
            for reg in regs:
                if reg is not None:
                    self.adapters.release(reg)
        return admission, reqs

    @property
    def max_seq_len(self) -> int:
        """Most tokens (prompt + output) one request may have: the settings' and the model's context."""
        return self.scheduler.config.max_seq_len

    def register_adapter(self, name: str, folder: Any) -> str:
        """Make the LoRA adapter in ``folder`` (a peft adapter folder) available as ``name``: its config
        is checked now (``lora.AdapterError``), its weights read when a request first names it. Returns
        its registration key (the prefix cache's salt for it). Callable from any thread."""
        return self.adapters.register(name, folder)

    def check_adapter(self, folder: Any) -> None:
        """Read the adapter in ``folder`` as a load would and drop it: ``lora.AdapterError`` says what
        is wrong (unreadable, unsupported, another model's shapes). Any thread; read on the CPU."""
        param = next(self.model.parameters())
        load_adapter("check", folder, self.model.config, param.dtype, "cpu", self.settings.max_lora_rank)

    def retire_adapter(self, name: str) -> bool:
        """New requests may no longer name ``name``; it leaves memory after its last request."""
        return self.adapters.retire(name)

    def adapter_stats(self) -> AdapterStats:
        return self.adapters.stats()

    def forget_prefixes(self, tenant: str, user_id: str) -> int:
        """Drop every prefix-cache block that requests of (tenant, user_id) computed or reused:
        free ones now, ones running requests hold once those finish (no request finds them
        again); that user's requests still in the engine cache nothing more. Returns how many
        blocks were dropped. Call it on the step thread (``AsyncEngine.forget_prefixes`` does)."""
        return self.scheduler.forget(tenant, user_id)

    def refusal_error(self, admission: Admission, request: Request) -> RequestRefused:
        """The named error for a refused request, with its size and the limit it hit: the waiting-queue
        bound, or the most tokens (prompt + new) one request may hold (max_seq_len, the model's
        context, the KV cache)."""
        config = self.scheduler.config
        too_large_limit = min(config.max_seq_len, self.allocator.capacity_tokens)
        limit = config.max_waiting if admission is Admission.OVERLOADED else too_large_limit
        return RequestRefused(admission, len(request.prompt_token_ids), request.params.max_new_tokens, limit)

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its KV cache is freed at the next step."""
        return self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- the step --------------------------------------------------------------------------------

    def step(self) -> list[TokenEvent]:
        started = time.monotonic()
        events = []
        if not self.adapters.unused:
            for key, reason in self.adapters.poll(*self.scheduler.adapter_keys()):
                for req in self.scheduler.fail_waiting(key, reason):
                    self.sampler.remove(req.request_id)
                    events.append(self._finished_event(req, None))
        bank = self.adapters.bank  # this step's adapters (a load finishing meanwhile joins the next step)
        out = self.scheduler.schedule()
        events += [self._finished_event(r, None) for r in out.finished]
        for r in out.finished:
            self.sampler.remove(r.request_id)
            self.runner.forget(r.request_id)
        for r in out.preempted:  # its blocks are gone; its generator stays (output unchanged)
            self.runner.forget(r.request_id)
        for r in out.admitted:
            self.sampler.add(r.request_id, r.params)
        if not out.chunks:
            self.adapters.wait_for_load(timeout=0.05)  # nothing to compute: let a load in progress run
            return events
        tables = {c.request.request_id: self.allocator.block_table(c.request.request_id) for c in out.chunks}
        batch = self.runner.prepare(out.chunks, tables, bank)
        logits = self.runner.forward(batch)  # [S, V]
        by_id = {c.request.request_id: c.request for c in out.chunks}
        reqs = [by_id[rid] for rid in batch.sample_request_ids]
        constraints = [r.constraint for r in reqs]
        res = self.sampler.sample_step(
            logits, batch.sample_request_ids, [r.params for r in reqs], [r.output_token_ids for r in reqs],
            constraints if any(c is not None for c in constraints) else None,
        )  # fmt: skip
        sampled = dict(zip(batch.sample_request_ids, res.token_ids))
        self.scheduler.update_from_output(out, sampled)
        prompt_computed = sum(
            max(0, min(c.start + c.num_new_tokens, len(c.request.prompt_token_ids)) - c.start) for c in out.chunks
        )
        self._count(prompt_computed, len(sampled), started)
        rejected = set(res.rejected)
        for i, (rid, tok) in enumerate(sampled.items()):
            req = reqs[i]
            if req.constraint is not None and not req.is_finished:
                if i in rejected:  # the mask allowed a token the matcher refuses: a bug, end this request only
                    req.error = f"the token constraint refused token {tok}, which its own mask allowed"
                    self.scheduler.finish(req, FinishReason.ERROR)
                elif req.constraint.is_terminated():  # it accepted its stop token
                    self.scheduler.finish(req, FinishReason.STOP)
            text = self._text(req, tok)
            lp, top = res.logprobs[i], res.top_logprobs[i]
            if req.is_finished:
                self.sampler.remove(rid)
                self.runner.forget(rid)
                events.append(self._finished_event(req, tok, text, lp, top))
            else:
                events.append(TokenEvent(rid, tok, finished=False, text=text, logprob=lp, top_logprobs=top))
        return events

    def _text(self, req: Request, token: int) -> str | None:
        """Feed the request's text stream; a completed stop string ends the request now."""
        ts = req.text_stream
        if ts is None:
            return None
        text = ts.push(token)
        if ts.stopped:
            self.scheduler.finish(req, FinishReason.STOP)
        elif req.is_finished:
            text += ts.finish()
            if ts.stopped:  # the held-back tail completed a stop string
                req.finish_reason = FinishReason.STOP
        return text

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams = SamplingParams()) -> list[list[int]]:
        """Offline helper: run ``prompts`` to completion, return each one's output token ids."""
        reqs = []
        for p in prompts:
            admission, req = self.add_request(p, params)
            if admission is not Admission.ACCEPTED:
                raise self.refusal_error(admission, req)
            reqs.append(req)
        while self.has_work():
            self.step()
        return [list(r.output_token_ids) for r in reqs]

    def stats(self) -> EngineStats:
        now = time.monotonic()
        counts = self._counts
        load = self.scheduler.load()
        decode_rate, prefill_rate = counts.throughput.rates(now)
        return EngineStats(
            running=self.scheduler.num_running,
            waiting=self.scheduler.num_waiting,
            kv_used_tokens=self.allocator.used_tokens,
            kv_capacity_tokens=self.allocator.capacity_tokens,
            kv_block_size=self.allocator.block_size,
            kv_in_use_blocks=self.allocator.num_in_use_blocks,
            kv_cached_blocks=self.allocator.num_cached_blocks,
            kv_evictable_blocks=self.allocator.num_evictable_blocks,
            kv_free_blocks=self.allocator.num_free_blocks - self.allocator.num_evictable_blocks,
            prefix_cache_hit_tokens=self.allocator.hit_tokens,
            preemptions=self.scheduler.num_preemptions,
            fairness_preemptions=self.scheduler.num_fairness_preemptions,
            priority_preemptions=self.scheduler.num_priority_preemptions,
            steps=counts.steps,
            prompt_tokens=counts.prompt_tokens,
            generated_tokens=counts.generated,
            tokens_per_s=counts.tokens_per_s(now),
            prefix_cache_cross_tenant_hit_tokens=self.allocator.cross_tenant_hit_tokens,
            prefix_cache_forgotten_blocks=self.allocator.forgotten_blocks,
            prefix_cache_queried_tokens=self.allocator.queried_tokens,
            max_running=self.scheduler.config.max_batch,
            queued_prompt_tokens=load.queued_prompt_tokens,
            queued_output_tokens=load.queued_output_tokens,
            running_output_tokens=load.running_output_tokens,
            decode_tokens_per_s=decode_rate,
            prefill_tokens_per_s=prefill_rate,
        )

    def _count(self, prompt_tokens: int, generated: int, started: float) -> None:
        now = time.monotonic()
        saturated = self.scheduler.num_waiting > 0 or self.scheduler.num_running >= self.scheduler.config.max_batch
        self._counts.record(now, now - started, prompt_tokens, generated, saturated)

    def _finished_event(
        self, req: Request, token: int | None, text: str | None = None, logprob: float | None = None,
        top_logprobs: tuple[tuple[int, float], ...] | None = None,
    ) -> TokenEvent:  # fmt: skip
        if req.adapter is not None:  # every request's end passes here once: its adapter may leave memory
            self.adapters.release(req.adapter)
        if text is None and req.text_stream is not None:
            text = req.text_stream.finish()  # cancelled: what was held back
        return TokenEvent(
            req.request_id, token, finished=True, finish_reason=req.finish_reason,
            timings=dataclasses.replace(req.timings),
            num_prompt_tokens=len(req.prompt_token_ids), num_output_tokens=len(req.output_token_ids), text=text,
            logprob=logprob, top_logprobs=top_logprobs, error=req.error, num_cached_tokens=req.num_cached_tokens,
        )  # fmt: skip
