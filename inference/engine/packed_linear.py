"""The projections' weights packed once for oneDNN, on CPU: the engine's dense math there.

A decode step on CPU is bound by reading the weights (docs/engine.md, "Profile of one step"), and
``F.linear`` (MKL's sgemm on a row-major weight) reads them at a fraction of what the machine can:
measured here (2-core AMD EPYC VM, 2 threads, fp32, SmolLM2-135M's shapes, 8 rows), oneDNN with the
weight reordered once into its blocked layout took 291 vs 618 us for the MLP's gate_up, 174 vs 272 us
for its down, 8.8 vs 24.1 ms for the LM head (49,152 x 576); 16 rows 566 vs 896 us, 11.9 vs 28.3 ms;
a 264-row prefill step 7.3 vs 8.4 ms (gate_up). vLLM's CPU backend does the same (its ``onednn_mm``
with prepacked weights); torch exposes oneDNN's packed linear as ``torch.ops.mkldnn``'s
``_reorder_linear_weight`` / ``_linear_pointwise`` (what inductor's CPU weight prepacking calls).

The packed copies belong to the runner: the Hugging Face modules keep their own weights (the
reference path, and ``generate`` on the same model object in tests and benches), so packing costs
one more copy of the projection weights in memory (540 MB for the default model in float32 with
its tied LM head). Numerics: oneDNN sums in another order than MKL, so logits differ in the last
bits; greedy tokens of the default model stay equal to HF ``generate``'s (tests/engine).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn.functional as F

SUPPORTED_DTYPES = (torch.float32,)  # bfloat16 packing needs avx512_bf16 and is not measured here


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch can pack weights for oneDNN here (CPU, a float32 model)."""
    return device.type == "cpu" and dtype in SUPPORTED_DTYPES and torch.backends.mkldnn.is_available()


class PackedLinears:
    """``linear(x, weight, bias)``: ``F.linear`` through the packed copy of ``weight`` when it is one of
    the weights packed here (by identity), else ``F.linear`` itself."""

    def __init__(self, weights: Iterable[torch.Tensor], batch_hint: int) -> None:
        self._batch_hint = batch_hint
        self._packed: dict[int, torch.Tensor] = {}
        self._stand_ins: list[torch.Tensor] = []  # held, so that no other tensor takes one of their ids
        for weight in weights:
            self.pack(weight)

    def pack(self, weight: torch.Tensor) -> None:
        """Pack ``weight``: ``linear`` calls with it use the packed copy from now on."""
        with torch.inference_mode():
            self._packed[id(weight)] = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), self._batch_hint)

    def pack_only(self, weight: torch.Tensor) -> torch.Tensor:
        """Pack ``weight`` and return a stand-in for it (an empty tensor of its dtype) that finds the packed
        copy, so that ``weight`` itself can go: for a copy made only to be packed (lean_llama's fused
        weights), which would otherwise stay in memory unused. ``F.linear`` on the stand-in raises (no
        shape matches an empty weight): a path that bypassed the packed copy fails loudly."""
        self.pack(weight)
        stand_in = weight.new_empty(0)
        self._packed[id(stand_in)] = self._packed.pop(id(weight))
        self._stand_ins.append(stand_in)
        return stand_in

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        packed = self._packed.get(id(weight))
        if packed is None:
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def hf_weights(model: Any) -> list[torch.Tensor]:
    """The weights of every projection of a Llama-family model's decoder layers, and its LM head's."""
    out = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        out += [m.weight for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj,
                                   mlp.down_proj)]
    return out + [model.lm_head.weight]
