"""The adapters in memory, stacked so that one step applies each row's own adapter (or none).

A step's rows belong to different requests, each naming an adapter or the base model. For every
adapted projection the bank holds all resident adapters' factors side by side: A of every slot stacked
into ``[S * r, in]`` and B into ``[out, S * r]`` (rank padded to the bank's largest with zeros; the
scaling folded into B). A step then adds, for a projection of input ``x`` [T, in] and output ``y``:

    y += ((x @ A_all.T) * mask) @ B_all.T        mask [T, S * r]: 1 on the columns of the row's slot

Two GEMMs and a multiply whatever the mix of adapters in the step; a base row's mask is all zeros, so
its output gets exactly ``+ 0.0`` (bit for bit the base model's). Projections that share an input
(q, k and v; gate and up) share one shrink GEMM: their A's are stacked too.

Why masked dense and not grouping rows by adapter (``index_select`` the rows of each adapter, two
small GEMMs, ``index_add_`` back): measured by ``bench/lora.py`` on a 2-core CPU, 4 rank-16 adapters and
the base in one batch of 20 ran at 0.92x the base model's tokens/s masked and 0.71x grouped: the
per-adapter ops cost more than the extra columns of the shrink GEMM while S is small
(docs/benchmarks.md); the masked form's cost grows with S * r, which ``max_loras`` and ``max_lora_rank``
bound. A CUDA deployment with many adapters would want a
segmented kernel (punica's SGMV) instead; that is vLLM's engine (issue 45).

A bank is immutable: ``adapters.py`` builds a new one when an adapter comes in or leaves and the
step loop picks it up at its next step, so loading never pauses a step in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from inference.engine.lora import LoraAdapter

# Projections grouped by the input they read; the order inside a group is the order of a fused output
# (lean_llama's qkv and gate_up GEMMs).
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


@dataclass(frozen=True)
class GroupFactors:
    """One projection group of one layer, over every slot of the bank."""

    present: tuple[int, ...]  # indices into GROUPS[group] of the projections some resident adapter adapts
    a_t: torch.Tensor  # [in, len(present) * S * r]: the A's, transposed once here (plain GEMMs per step)
    b_t: tuple[torch.Tensor, ...]  # per present projection: [S * r, out], B transposed


@dataclass(frozen=True)
class LoraBank:
    slots: dict[str, int] = field(default_factory=dict)  # adapter key -> slot
    rank: int = 0  # columns per slot (the largest rank of the resident adapters)
    layers: tuple[dict[str, GroupFactors], ...] = ()

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    @classmethod
    def build(cls, adapters: Sequence[tuple[str, LoraAdapter]], num_layers: int) -> "LoraBank":
        """The bank of ``adapters`` ((key, adapter) in slot order)."""
        if not adapters:
            return cls()
        rank = max(a.rank for _, a in adapters)
        layers = []
        for layer in range(num_layers):
            groups = {}
            for group, projections in GROUPS.items():
                present, a_parts, bs = [], [], []
                for i, proj in enumerate(projections):
                    factors = [ad.factors.get((layer, proj)) for _, ad in adapters]
                    if all(f is None for f in factors):
                        continue
                    present.append(i)
                    a_parts.append(_stack_a(factors, rank))
                    bs.append(_stack_b(factors, rank))
                if present:
                    groups[group] = GroupFactors(tuple(present), torch.cat(a_parts).T.contiguous(),
                                                 tuple(b.T.contiguous() for b in bs))
            layers.append(groups)
        return cls(slots={key: i for i, (key, _) in enumerate(adapters)}, rank=rank, layers=tuple(layers))

    def row_mask(self, row_keys: Sequence[str | None], like: torch.Tensor) -> torch.Tensor | None:
        """The step's mask [T, S * r] (dtype and device of ``like``) for rows whose adapter keys are
        ``row_keys`` (None: the base model); None when no row uses an adapter."""
        slots = [self.slots[k] if k is not None else -1 for k in row_keys]
        if all(s < 0 for s in slots):
            return None
        slot_of_row = torch.tensor(slots, device=like.device)
        slot_of_col = torch.arange(self.num_slots, device=like.device).repeat_interleave(self.rank)
        return (slot_of_row[:, None] == slot_of_col[None, :]).to(like.dtype)

    def add_(self, layer: int, group: str, x: torch.Tensor, outs: Sequence[torch.Tensor], mask: torch.Tensor) -> None:
        """``outs[i] += delta`` of GROUPS[group][i] for input ``x`` [T, in]; ``outs`` may be views
        (a fused GEMM's columns). Projections no resident adapter adapts are left alone."""
        g = self.layers[layer].get(group)
        if g is None:
            return
        width = self.num_slots * self.rank
        xa = torch.mm(x, g.a_t).view(x.shape[0], len(g.present), width)
        xa.mul_(mask[:, None, :])
        for j, i in enumerate(g.present):
            outs[i].addmm_(xa[:, j], g.b_t[j])


def _stack_a(factors: list, rank: int) -> torch.Tensor:
    """[S * rank, in]: each slot's A padded with zero rows to ``rank`` (zeros where it has none)."""
    ref = next(f for f in factors if f is not None).a
    out = ref.new_zeros(len(factors) * rank, ref.shape[1])
    for s, f in enumerate(factors):
        if f is not None:
            out[s * rank : s * rank + f.a.shape[0]] = f.a
    return out


def _stack_b(factors: list, rank: int) -> torch.Tensor:
    """[out, S * rank]: each slot's scaled B padded with zero columns."""
    ref = next(f for f in factors if f is not None).b
    out = ref.new_zeros(ref.shape[0], len(factors) * rank)
    for s, f in enumerate(factors):
        if f is not None:
            out[:, s * rank : s * rank + f.b.shape[1]] = f.b
    return out
