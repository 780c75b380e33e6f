"""Next-token choice per request: greedy, or temperature / top-k / top-p sampling with a per-request
seeded generator.

Greedy rows are one vectorised argmax. Sampled rows are handled one by one (a step has at most
``max_batch`` of them) because each request owns its ``torch.Generator``: that is what makes "same
seed, same output" hold whatever else shares the batch. Logits are float32 here.

Not here: stop strings (text-level, ``text.py``), repetition penalties, logit bias, beam search.
"""

from __future__ import annotations

import torch

from inference.engine.request import SamplingParams


class Sampler:
    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._generators: dict[str, torch.Generator] = {}
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

    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> list[int]:
        """logits [S, V] -> one token id per row."""
        out = logits.argmax(dim=-1)  # [S]; kept for greedy rows
        for i, (rid, p) in enumerate(zip(request_ids, params)):
            if not p.greedy:
                out[i] = sample_row(logits[i], p, self._generators[rid])
        return out.tolist()


def sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    """logits [V] -> token id, drawn after temperature, top-k, then top-p (nucleus) filtering."""
    scores = logits / p.temperature
    if p.top_k and p.top_k < scores.shape[-1]:
        kth = torch.topk(scores, p.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        # Drop a token when the tokens ranked above it already reach top_p; the first one always stays.
        drop_sorted = (cum - sorted_scores.softmax(-1)) >= p.top_p
        drop = torch.empty_like(drop_sorted).scatter_(0, order, drop_sorted)  # back to vocab order
        scores = scores.masked_fill(drop, float("-inf"))
    probs = scores.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))
