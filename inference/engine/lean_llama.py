"""A lean Llama-family decoder layer over the Hugging Face model's own weights.

``ModelRunner``'s reference path calls the HF submodules one by one: three q/k/v GEMMs, two MLP
GEMMs, HF's ``apply_rotary_pos_emb`` (``rotate_half`` builds a new tensor with a ``cat`` for q and
again for k) and two separate residual adds and RMSNorms: 45 non-view ops per layer in a SmolLM2
decode step (counted with a TorchDispatchMode), 31 here. Here a layer is:

* one qkv GEMM (q, k and v weights, and biases where the model has them, concatenated once at
  load) whose output is split into q, k, v by views;
* rotary embedding applied in place, to q and k together (they are adjacent heads of the qkv
  output), with the model's own cos/sin;
* a residual add fused with the next RMSNorm (``add_rms_norm``: the new residual is written in
  place and the normed value returned);
* one gate_up GEMM, then SiLU(gate) * up and the down projection.

The math is HF's, op for op (same float32 RMSNorm, same rotary sums and products), so float32
results equal the reference path exactly wherever the GEMM library rounds the fused GEMM as it
rounds the separate ones: on CPU (MKL) SmolLM2's logits were bit for bit the HF path's at every
step size tried, batch-1 decode included (``_cat_aligned_like``: why that needs care). On CUDA
cuBLAS may pick another kernel for the wider fused GEMM, so expect bfloat16-rounding differences
there (tests/engine/test_lean_llama.py checks both dtypes against HF within tolerance).

Memory: the fused qkv and gate_up weights are new tensors, an extra ``(Hq + 2 Hkv) * D * hidden +
2 * intermediate * hidden`` elements per layer: for SmolLM2-135M 2.32 M per layer, 69.7 M over its
30 layers (279 MB in float32, about half of the model's 134.5 M parameters again). The norms,
o_proj and down_proj are the HF tensors themselves, not copies. Where the runner packs the weights for
oneDNN (CPU, float32: packed_linear.py) the packed copy is what gets multiplied, so ``from_hf(model,
packed)`` packs each layer's fused weights as they are made and keeps empty stand-ins instead:
the lean layers then cost no memory (the next layer's fused copy reuses the freed one's memory). The HF
q/k/v/gate/up weights are kept on purpose: the HF modules stay the reference path
(``lean_layers=off``, ``generate`` on the same model in the tests).

Supported: the model types of ``model_runner.SUPPORTED_MODEL_TYPES`` (``llama``, ``mistral``,
``qwen2``: same layer layout; qwen2 has q/k/v biases, Llama's optional ``attention_bias`` and
``mlp_bias`` are handled too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: in float32, ``x * rsqrt(mean(x^2) + eps)``, cast back, times weight.

    ``F.rms_norm`` without a weight does the float32 part in one kernel where torch has one (CUDA);
    on CPU it gave the same bits as HF's pow/mean/rsqrt sequence. The weight is applied after the
    cast back, as HF does, so that bfloat16 rounds where HF rounds."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x`` (in place, in the model dtype as HF adds) and RMSNorm of the sum.

    One function, not yet one kernel: in eager torch it is an in-place add, ``F.rms_norm`` and the
    weight multiply (with casts in bfloat16); a fused kernel can replace this function alone.
    Returns ``(normed, residual)``; ``residual`` is the argument tensor, updated. In place so a
    layer allocates no new residual; the caller must own ``residual`` (ModelRunner's is the
    embedding output, then this function's own result)."""
    residual.add_(x)
    return rms_norm(residual, weight, eps), residual


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in place on ``x`` [T, H, D] (any strides) with ``cos``, ``sin`` [T, D].

    The same sums and products as transformers' ``apply_rotary_pos_emb``
    (``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``), written per half:
    ``x1' = x1 * cos1 - x2 * sin1`` and ``x2' = x2 * cos2 + x1 * sin2``; ``a + (-b)`` and ``a - b``
    round alike, so the result is bit for bit HF's. Only ``x1'`` needs a temporary."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, None], sin[:, None]  # [T, 1, D]: broadcast over heads
    x1, x2 = x[..., :half], x[..., half:]
    new_x1 = x1 * cos[..., :half] - x2 * sin[..., :half]
    x2.mul_(cos[..., half:]).add_(x1 * sin[..., half:])
    x1.copy_(new_x1)
    return x


# F.linear's signature: (x, weight, bias) -> x @ weight.T + bias (packed_linear.PackedLinears has it too).
Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
# Adds LoRA deltas in place: (projection group of lora_bank.GROUPS, its input, its outputs in group order).
LoraHook = Callable[[str, torch.Tensor, list[torch.Tensor]], None]


@dataclass(frozen=True)
class LeanLayer:
    """One decoder layer's weights for the lean path (fused where fusing saves kernels)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    input_norm: torch.Tensor  # [hidden], the HF tensor
    input_eps: float
    post_norm: torch.Tensor  # [hidden], the HF tensor
    post_eps: float
    qkv_weight: torch.Tensor  # [(Hq + 2 Hkv) * D, hidden], a fused copy
    qkv_bias: torch.Tensor | None  # [(Hq + 2 Hkv) * D] (qwen2), a fused copy
    gate_up_weight: torch.Tensor  # [2 * intermediate, hidden], a fused copy
    gate_up_bias: torch.Tensor | None
    down_proj: torch.nn.Module  # the HF module (one GEMM already)
    act: Callable[[torch.Tensor], torch.Tensor]

    @classmethod
    def from_hf(cls, layer: Any, num_heads: int, num_kv_heads: int, head_dim: int,
                pack_only: Callable[[torch.Tensor], torch.Tensor] = lambda weight: weight) -> "LeanLayer":
        """From one HF decoder layer (LlamaDecoderLayer and its mistral/qwen2 twins). ``pack_only``
        takes each fused weight and returns what the layer keeps (``PackedLinears.pack_only``: a
        stand-in for its packed copy; by default the weight itself)."""
        attn, mlp = layer.self_attn, layer.mlp
        projs = (attn.q_proj, attn.k_proj, attn.v_proj)
        return cls(
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            input_norm=layer.input_layernorm.weight,
            input_eps=layer.input_layernorm.variance_epsilon,
            post_norm=layer.post_attention_layernorm.weight,
            post_eps=layer.post_attention_layernorm.variance_epsilon,
            qkv_weight=pack_only(_cat_aligned_like([p.weight for p in projs])),
            qkv_bias=_cat_biases(projs),
            gate_up_weight=pack_only(_cat_aligned_like([mlp.gate_proj.weight, mlp.up_proj.weight])),
            gate_up_bias=_cat_biases((mlp.gate_proj, mlp.up_proj)),
            down_proj=mlp.down_proj,
            act=mlp.act_fn,  # the HF module's own activation (SiLU in every supported model)
        )

    def qkv_rope(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lora: LoraHook | None = None,
        linear: Linear = F.linear,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, Hq, D], k and v [T, Hkv, D] (views of one qkv tensor), rotary
        applied to q and k. cos, sin [T, D] as the model's rotary embedding gives them. ``lora``
        adds the adapters' deltas to the q, k and v columns before the rotary."""
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = linear(x, self.qkv_weight, self.qkv_bias)
        if lora is not None:
            lora("qkv", x, [qkv[:, : hq * d], qkv[:, hq * d : (hq + hkv) * d], qkv[:, (hq + hkv) * d :]])
        qkv = qkv.view(x.shape[0], hq + 2 * hkv, d)
        rotary_(qkv[:, : hq + hkv], cos, sin)  # q and k heads are adjacent: one rotary for both
        return qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]

    def mlp(self, x: torch.Tensor, lora: LoraHook | None = None, linear: Linear = F.linear) -> torch.Tensor:
        """down(act(gate(x)) * up(x)) with gate and up as one GEMM; ``lora`` adds the adapters' deltas
        to gate, up and down. ``linear``: ``F.linear`` or the runner's packed weights (packed_linear.py)."""
        gate, up = linear(x, self.gate_up_weight, self.gate_up_bias).chunk(2, dim=-1)
        down = self.down_proj
        if lora is None:  # act() is a new contiguous tensor: mul in place
            return linear(self.act(gate).mul_(up), down.weight, down.bias)
        lora("gate_up", x, [gate, up])
        y = self.act(gate).mul_(up)
        out = linear(y, down.weight, down.bias)
        lora("down", y, [out])
        return out


def _cat_aligned_like(weights: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(weights)`` (rows), placed at the first weight's address modulo 64 bytes.

    Why: MKL's single-row GEMM (a batch-1 decode step, T = 1) rounds differently depending on
    where the weight sits relative to a 64-byte line. Safetensors loads SmolLM2's weights at
    40 mod 64; a freshly allocated (aligned) copy, fused or not, then gave logits 2-4e-5 away from
    the HF modules' at T = 1 (T >= 2 was exact either way). At the same offset the fused GEMM's
    rows are bit for bit the separate GEMMs' (each part keeps the offset where a row is a multiple
    of 64 bytes long: hidden sizes of 576, 896, 2048, 4096 are). Costs 64 bytes per tensor."""
    first = weights[0].detach()
    size = first.element_size()
    flat = torch.empty(sum(w.numel() for w in weights) + 64 // size, dtype=first.dtype, device=first.device)
    start = (first.data_ptr() - flat.data_ptr()) % 64 // size
    out = flat[start : start + flat.numel() - 64 // size].view(-1, *first.shape[1:])
    return torch.cat([w.detach() for w in weights], out=out)


def _cat_biases(linears: tuple[Any, ...]) -> torch.Tensor | None:
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        return None
    # A model with bias on some of the fused projections only: zeros stand in for the missing ones.
    return torch.cat([
        b.detach() if b is not None else lin.weight.new_zeros(lin.out_features) for b, lin in zip(biases, linears)
    ])  # fmt: skip


@dataclass(frozen=True)
class LeanLlama:
    """The lean layers of a whole HF causal LM (embeddings, rotary, final norm, LM head stay HF's)."""

    layers: list[LeanLayer]

    @classmethod
    def from_hf(cls, model: Any, packed: Any = None) -> "LeanLlama":
        """``packed``: a ``packed_linear.PackedLinears`` that packs the layers' weights (fused ones kept
        only as stand-ins, the HF down projections as they are); pass it as ``linear`` to the layer calls."""
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        keep = packed.pack_only if packed is not None else (lambda weight: weight)
        with torch.no_grad():
            layers = [
                LeanLayer.from_hf(layer, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim, keep)
                for layer in model.model.layers
            ]
        if packed is not None:
            for layer in layers:
                packed.pack(layer.down_proj.weight)
        return cls(layers)
