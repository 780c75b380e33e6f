"""Next-token choice for the rows of a step: penalties, a token constraint's mask, greedy or
temperature / top-k / top-p sampling with a per-request seeded generator, and log-probabilities.

Order, on the step's float32 logits ``[S, V]``:
  1. log-probabilities (``params.logprobs``) from the *raw* logits: one ``log_softmax`` over the
     rows that want them, one ``topk`` (vLLM's default "raw logprobs"; OpenAI's are of the
     distribution actually sampled from, which differs once a penalty, temperature or mask applies);
  2. presence / frequency penalties (OpenAI semantics over the output tokens so far), one
     ``index_add_`` over the penalised rows; each such request keeps a ``[V]`` count row on the device,
     updated by one scatter per step;
  3. a constraint's mask (``Request.constraint``, an ``xgrammar.GrammarMatcher``): one int32 bitmask
     for the step, filled on the host for the constrained rows only (on CUDA this overlaps the
     forward, which was queued before), applied with ``xgrammar.apply_token_bitmask_inplace``;
  4. greedy rows: one vectorised argmax; sampled rows: temperature, top-k, top-p vectorised over
     the rows, then each row draws with its own ``torch.Generator`` (an exponential race,
     ``argmax(p / q)`` with ``q ~ Exp(1)``: what ``torch.multinomial`` does for one sample, without its
     host-side check). A row's draw reads its own generator only, which is what makes "same seed,
     same output" hold whatever else shares the batch;
  5. one device-to-host copy (``.tolist()``) of tokens and logprobs together, then the constrained
     rows' matchers accept their token.

Not here: stop strings (text-level, ``text.py``), repetition penalty (multiplicative, not OpenAI's),
logit bias, beam search.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from inference.engine.request import SamplingParams

TopLogprobs = tuple[tuple[int, float], ...]


@dataclass
class StepSample:
    """What the sampler chose for each row of a step, in row order."""

    token_ids: list[int]
    logprobs: list[float | None]  # the chosen token's raw logprob; None where params.logprobs is None
    top_logprobs: list[TopLogprobs | None]  # (token id, logprob) best first; () for logprobs=0
    rejected: list[int] = field(default_factory=list)  # rows whose constraint refused the token


class Sampler:
    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._generators: dict[str, torch.Generator] = {}
        # Output-token counts of penalised requests, [V] float32 on the device (a row of the last
        # step's stacked counts), and how many output tokens they hold (a mismatch rebuilds them).
        self._counts: dict[str, tuple[torch.Tensor, int]] = {}
        self._bitmask: torch.Tensor | None = None  # host buffer, reused step to step
        # Seeds for requests without one, from the OS's entropy. Its own generator: torch.seed()
        # would reseed the process-wide RNG under every other seeded computation in the process.
        self._seeder = torch.Generator()
        self._seeder.seed()

    def add(self, request_id: str, params: SamplingParams) -> None:
        """Idempotent: a preempted request that is admitted again keeps its generator's state."""
        if params.greedy or request_id in self._generators:
            return
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._seeder))
        self._generators[request_id] = torch.Generator(device=self.device).manual_seed(seed)

    def remove(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._counts.pop(request_id, None)

    @torch.inference_mode()  # the forward's logits are inference tensors: updated in place here
    def sample_step(
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams],
        outputs: Sequence[Sequence[int]] | None = None, constraints: Sequence[Any] | None = None,
    ) -> StepSample:  # fmt: skip
        """logits [S, V] (modified in place) -> each row's token and logprobs. ``outputs[i]`` is row
        i's output tokens so far (penalties count them; needed when a row is penalised),
        ``constraints[i]`` its constraint or None. A constrained row's matcher accepts its token
        here; rows it refused are listed in ``rejected``."""
        s, v = logits.shape
        if s == 0:
            return StepSample([], [], [])
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        lp = top = None
        if lp_rows:  # 1. from the raw logits, before anything below changes them
            lp = torch.log_softmax(logits if len(lp_rows) == s else logits[self._index(lp_rows)], dim=-1)
            k = max(params[i].logprobs for i in lp_rows)
            top = torch.topk(lp, k, dim=-1) if k else None  # sorted, best first
        pen_rows = [i for i, p in enumerate(params) if p.penalized]
        counts = None
        if pen_rows:  # 2.
            assert outputs is not None, "penalised rows need their output tokens"
            counts = torch.stack([self._count_row(request_ids[i], outputs[i], v) for i in pen_rows])  # [P, V]
            freq = self._tensor([params[i].frequency_penalty for i in pen_rows], torch.float32)[:, None]
            pres = self._tensor([params[i].presence_penalty for i in pen_rows], torch.float32)[:, None]
            logits.index_add_(0, self._index(pen_rows), -(freq * counts + pres * (counts > 0)))
        con_rows = [i for i in range(s) if constraints is not None and constraints[i] is not None]
        if con_rows:  # 3.
            self._apply_constraints(logits, [constraints[i] for i in con_rows], con_rows)
        out = logits.argmax(dim=-1)  # 4. [S]; kept for greedy rows
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        invalid = None
        if sampled_rows:
            rows = self._index(sampled_rows)
            gens = [self._generators[request_ids[i]] for i in sampled_rows]
            drawn, invalid = draw(logits[rows], [params[i] for i in sampled_rows], gens)
            out.index_copy_(0, rows, drawn)
        if counts is not None:  # the chosen tokens count from the next step on
            picked = out[self._index(pen_rows)]
            ones = torch.ones(len(pen_rows), device=counts.device)
            counts.index_put_((torch.arange(len(pen_rows), device=counts.device), picked), ones, accumulate=True)
            for j, i in enumerate(pen_rows):
                self._counts[request_ids[i]] = (counts[j], len(outputs[i]) + 1)
        result = self._to_host(out, lp, top, lp_rows, params, invalid)  # 5. the step's one device-to-host copy
        for i in con_rows:
            if not constraints[i].accept_token(result.token_ids[i]):
                result.rejected.append(i)
        return result

    # -- helpers ---------------------------------------------------------------------------------

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return small_tensor(values, dtype, self.device)

    def _index(self, rows: list[int]) -> torch.Tensor:
        return self._tensor(rows, torch.long)

    def _count_row(self, request_id: str, output: Sequence[int], vocab: int) -> torch.Tensor:
        kept = self._counts.get(request_id)
        if kept is not None and kept[1] == len(output):
            return kept[0]
        # First penalised step of the request (or its counts are stale): count its output once.
        row = torch.zeros(vocab, dtype=torch.float32, device=self.device)
        if output:
            row.index_add_(0, self._index(list(output)), torch.ones(len(output), device=self.device))
        return row

    def _apply_constraints(self, logits: torch.Tensor, constraints: list[Any], rows: list[int]) -> None:
        import xgrammar  # lazily: only steps with a constrained row need it

        s, v = logits.shape
        words = (v + 31) // 32
        buf = self._bitmask
        if buf is None or buf.shape[0] < s or buf.shape[1] != words:
            # Pinned on CUDA: the copy below is then asynchronous. Reusing it next step is safe: that
            # step starts after this one's device-to-host copy, so this copy is done.
            buf = torch.empty(max(s, 8), words, dtype=torch.int32, pin_memory=self.device.type == "cuda")
            self._bitmask = buf
        mask = buf[:s]
        for c, i in zip(constraints, rows):
            c.fill_next_token_bitmask(mask, i)
        if self.device.type != "cpu":
            mask = mask.to(self.device, non_blocking=True)
        xgrammar.apply_token_bitmask_inplace(logits, mask, vocab_size=v, indices=rows)

    def _to_host(
        self, out: torch.Tensor, lp: torch.Tensor | None, top: Any, lp_rows: list[int], params: list[SamplingParams],
        invalid: torch.Tensor | None,
    ) -> StepSample:
        """One device-to-host copy of everything; ``invalid`` (sampled rows' probabilities had a
        NaN) travels in it too and raises here, as ``torch.multinomial`` would have."""
        s = out.shape[0]
        if lp is None:
            if invalid is None:
                return StepSample(out.tolist(), [None] * s, [None] * s)
            flat = torch.cat([out, invalid.long()[None]]).tolist()
            _raise_if(flat[-1])
            return StepSample(flat[:s], [None] * s, [None] * s)
        chosen_ids = out if len(lp_rows) == s else out[self._index(lp_rows)]
        chosen = lp.gather(1, chosen_ids[:, None])[:, 0]  # [L]
        parts = [out.double(), chosen.double()]
        k = 0
        if top is not None:
            k = top.values.shape[1]
            parts += [top.values.double().flatten(), top.indices.double().flatten()]
        if invalid is not None:
            parts.append(invalid.double()[None])
        flat = torch.cat(parts).tolist()  # exact: token ids < 2**53, float32 logprobs in float64
        if invalid is not None:
            _raise_if(flat.pop())
        n = len(lp_rows)
        tokens = [int(t) for t in flat[:s]]
        logprobs: list[float | None] = [None] * s
        tops: list[TopLogprobs | None] = [None] * s
        vals, ids = flat[s + n : s + n + n * k], flat[s + n + n * k :]
        for j, i in enumerate(lp_rows):
            logprobs[i] = flat[s + j]
            want = params[i].logprobs
            tops[i] = tuple((int(ids[j * k + r]), vals[j * k + r]) for r in range(want))
        return StepSample(tokens, logprobs, tops)


def draw(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] of sampled rows -> ([R] token ids, a 0-dim bool "some probability is NaN"),
    both on the device (no host sync): temperature, top-k, then top-p (nucleus) filtering,
    vectorised over the rows, and one draw per row from its own generator."""
    r, v = logits.shape
    dev = logits.device
    scores = logits / small_tensor([p.temperature for p in params], torch.float32, dev)[:, None]
    ks = [p.top_k if 0 < p.top_k < v else 0 for p in params]
    if any(ks):  # keep the tokens scoring at least the k-th best (ties kept)
        kth_index = small_tensor([max(k - 1, 0) for k in ks], torch.long, dev)[:, None]
        kth = torch.topk(scores, max(ks), dim=-1).values.gather(1, kth_index)  # [R, 1]
        has_k = small_tensor([k > 0 for k in ks], torch.bool, dev)[:, None]
        scores = scores.masked_fill(has_k & (scores < kth), float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        # Drop a token when the tokens ranked above it already reach top_p; the first one always stays.
        top_p = small_tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params], torch.float32, dev)[:, None]
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(-1)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
        drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)  # back to vocab order
        scores = scores.masked_fill(drop, float("-inf"))
    probs = scores.softmax(-1)
    q = torch.empty_like(probs)
    for row, g in zip(q, generators):
        row.exponential_(generator=g)
    return (probs / q).argmax(dim=-1), probs.isnan().any()


def _raise_if(invalid: float) -> None:
    if invalid:  # the words of torch.multinomial's own check, which callers and tests know
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0 (non-finite logits)")


def small_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device without a blocking copy (pinned + non_blocking on CUDA; a
    plain ``torch.tensor(..., device=cuda)`` waits for the stream, i.e. is a host sync)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)

