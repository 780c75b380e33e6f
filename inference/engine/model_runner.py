"""One ragged forward pass of a Llama-family model over the paged KV cache.

All tokens computed in a step (running requests' next tokens and new requests' prompt chunks) go
through the dense layers together as one ``[T, hidden]`` matrix, which is where batching pays.
Attention is the only per-request part: the single-token rows ("decodes") attend in one padded
SDPA call, each multi-token prompt chunk in its own SDPA call with a causal mask over its cached
prefix. A step thus mixes prefill into running decode without padding decodes to prompt length.

The runner reuses the Hugging Face model's own modules (embeddings, norms, projections, rotary
embedding, MLP, LM head) and replaces only the attention/cache plumbing, so the math is the
model's. With ``lean=True`` the layers' dense math runs through ``lean_llama`` instead (fused qkv
and gate_up GEMMs, rotary in place, residual add fused with RMSNorm) on the same weights; the HF
modules stay the reference path. Rows may run with LoRA adapters (``lora_bank.py``): each adapted
projection's output gets its row's low-rank delta, on either path. Supported: ``llama`` (SmolLM, Llama 2/3), ``mistral`` and
``qwen2`` without sliding windows. Other architectures are refused with ``UnsupportedModelError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from inference.engine.errors import UnsupportedModelError
from inference.engine.kernels import cpu_paged_attention, paged_attention
from inference.engine.kv_cache import BlockGather, DeviceBlockTables, PagedKVCache, slots_for_positions
from inference.engine.lean_llama import LeanLlama, add_rms_norm, rms_norm
from inference.engine.lora_bank import LoraBank
from inference.engine.packed_linear import PackedLinears, hf_weights
from inference.engine.scheduler import ScheduledChunk

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


# A decode group costs about this many padded context blocks' worth of work on top of its blocks (its
# gathers, SDPA call and copies, per layer): split_by_length's trade of padding against calls.
GROUP_OVERHEAD_BLOCKS = 12


@dataclass
class PrefillSpan:
    rows: slice  # rows of the step's [T] tokens that belong to this chunk
    gather: BlockGather  # cache blocks of positions 0..K-1 (K = chunk end position)
    mask: torch.Tensor  # [G * n, N * block_size] additive (0 may attend, -inf not; causal over prefix + chunk),
    # repeated for the G query heads per KV head once here rather than in every layer


@dataclass
class DecodeGroup:
    """Decode rows of similar context length that attend in one padded SDPA call."""

    rows: slice  # rows of the step's [T] tokens (decodes are sorted by context length)
    gather: BlockGather  # each row's context blocks, up to the group's longest
    mask: torch.Tensor  # [1, b, 1, N * block_size] additive: -inf past each row's context


@dataclass(frozen=True)
class StepLora:
    """The adapters of a step: the bank it runs with and each row's slot as a column mask."""

    bank: LoraBank
    mask: torch.Tensor  # [k, S * r] (lora_bank.LoraBank.row_mask) for the step's first k rows: the
    # rows after the last one with an adapter are skipped (a base prompt chunk behind adapter decodes)

    def add_(self, layer: int, group: str, x: torch.Tensor, outs: list[torch.Tensor]) -> None:
        k = self.mask.shape[0]
        self.bank.add_(layer, group, x[:k], [out[:k] for out in outs], self.mask)


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long, position of each token inside its own request
    write_slots: torch.Tensor  # [T] long, cache slot each token's K/V is written to
    num_decodes: int  # rows [0, num_decodes) are single-token chunks
    decode_ctx_blocks: torch.Tensor | None  # [Bd, Nd] long, blocks of each decode's context
    decode_lens: torch.Tensor | None  # [Bd] long, tokens each decode attends to (its own included)
    decode_groups: list[DecodeGroup]  # the decodes' SDPA calls (none with the paged kernel)
    prefills: list[PrefillSpan]
    sample_rows: torch.Tensor  # [S] long, rows whose logits pick a next token
    sample_request_ids: list[str]
    lora: StepLora | None = None  # None: every row runs on the base model


def check_supported(config: Any, max_seq_len: int) -> None:
    model_type = getattr(config, "model_type", "?")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported by the engine's forward pass; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)} (Llama-family decoder-only models)"
        )
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if window is not None and window < max_seq_len:
        raise UnsupportedModelError(
            f"sliding-window attention (window {window}) is not implemented; set max_seq_len <= {window}"
        )


class ModelRunner:
    def __init__(
        self, model: Any, cache: PagedKVCache, compile: bool = False, lean: bool = False, paged_kernel: str | None = None,
        packed_linear: bool = False, batch_hint: int = 16,
    ) -> None:
        self.model = model
        self.cache = cache
        self.device = next(model.parameters()).device
        cfg = model.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.groups = self.num_heads // self.num_kv_heads  # query heads per KV head (GQA)
        # Decode attention by a kernel that reads the pool in place instead of read_blocks' gather + SDPA:
        # "triton" (kernels/paged_attention.py, CUDA) or "cpu" (kernels/cpu_paged_attention.py);
        # EngineSettings.resolved_paged_kernel decides.
        self.paged_decode = {"triton": paged_attention.paged_decode_attention,
                             "cpu": cpu_paged_attention.paged_decode_attention}.get(paged_kernel or "")
        max_pos = getattr(cfg, "max_position_embeddings", None) or 1 << 16
        self.tables = DeviceBlockTables(-(-min(max_pos, cache.num_slots) // cache.block_size), self.device)
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self._rope = apply_rotary_pos_emb
        # The projections through oneDNN-packed copies of their weights (packed_linear.py: CPU); on the lean
        # path its fused weights are the ones packed, built once per runner (lean_llama's docstring: what
        # they cost, nothing once packed).
        self.packed = packed_linear
        self.linear = F.linear
        if packed_linear:
            o_projs = [layer.self_attn.o_proj.weight for layer in model.model.layers]  # both paths call the HF o_proj
            self.linear = PackedLinears(o_projs + [model.lm_head.weight] if lean else hf_weights(model), batch_hint)
        self.lean = LeanLlama.from_hf(model, self.linear if packed_linear else None) if lean else None
        if compile:  # the HF MLP modules: the lean path does not call them
            for layer in model.model.layers:
                layer.mlp.compile(dynamic=True)

    def forget(self, request_id: str) -> None:
        """The request finished or was preempted: drop its device block table."""
        self.tables.forget(request_id)

    # -- building a step -------------------------------------------------------------------------

    def prepare(self, chunks: list[ScheduledChunk], block_tables: dict[str, list[int]],
                bank: LoraBank | None = None) -> StepBatch:
        """Chunks must list single-token chunks first (the scheduler does). ``bank``: the adapters in
        memory, which hold every adapter the chunks' requests name. The step's rows put the decodes
        in order of context length, so that requests of similar length share an attention call."""
        bs = self.cache.block_size
        num_single = next((i for i, c in enumerate(chunks) if c.num_new_tokens != 1), len(chunks))
        chunks = sorted(chunks[:num_single], key=lambda c: c.start) + list(chunks[num_single:])
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        decode_ids: list[str] = []
        decode_lens: list[int] = []
        prefills: list[tuple[int, int, ScheduledChunk]] = []
        for chunk in chunks:
            req, start, n = chunk.request, chunk.start, chunk.num_new_tokens
            row0 = len(ids)
            positions = range(start, start + n)
            ids.extend(req.token_at(p) for p in positions)
            pos.extend(positions)
            table = block_tables[req.request_id]
            slots.extend(slots_for_positions(table, positions, bs))
            if n == 1:
                decode_ids.append(req.request_id)
                decode_lens.append(start + 1)
            else:
                prefills.append((row0, row0 + n, chunk))
            if chunk.sample:
                sample_rows.append(row0 + n - 1)
                sample_ids.append(req.request_id)
        dev = self.device
        decode_ctx = lens = None
        groups: list[DecodeGroup] = []
        if decode_ids:
            decode_ctx = self.tables.gather(decode_ids, block_tables, max(decode_lens), bs)
            lens = torch.tensor(decode_lens, device=dev)
            if self.paged_decode is None:  # a kernel reads each row's own length in place
                for i, j in split_by_length(decode_lens, bs, GROUP_OVERHEAD_BLOCKS):
                    ctx = decode_ctx[i:j, : -(-decode_lens[j - 1] // bs)]  # up to the group's longest
                    # context rounded up to whole blocks; the mask hides each row's tail
                    keep = torch.arange(ctx.shape[1] * bs, device=dev)[None, :] < lens[i:j, None]
                    groups.append(DecodeGroup(slice(i, j), self.cache.block_gather(ctx),
                                              self._additive(keep)[None, :, None, :]))
        spans = []
        for row0, row1, chunk in prefills:
            end = chunk.start + chunk.num_new_tokens
            ctx = self.tables.gather([chunk.request.request_id], block_tables, end, bs)
            q_pos = torch.arange(chunk.start, end, device=dev)
            # Causal; positions past `end` (the rest of the last block) are > every q_pos, so hidden.
            keep = torch.arange(ctx.shape[1] * bs, device=dev)[None, :] <= q_pos[:, None]  # [n, N*bs]
            spans.append(PrefillSpan(slice(row0, row1), self.cache.block_gather(ctx),
                                     self._additive(keep.repeat(self.groups, 1))))  # [G*n, N*bs]
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev)
        lora = None
        if bank is not None and bank.num_slots:
            row_keys = [c.request.adapter_key for c in chunks for _ in range(c.num_new_tokens)]
            last = max((i for i, key in enumerate(row_keys) if key is not None), default=-1)
            mask = bank.row_mask(row_keys[: last + 1], self.cache.k[0])
            lora = StepLora(bank, mask) if mask is not None else None
        return StepBatch(
            input_ids=as_long(ids),
            positions=as_long(pos),
            write_slots=as_long(slots),
            num_decodes=len(decode_ids),
            decode_ctx_blocks=decode_ctx,
            decode_lens=lens,
            decode_groups=groups,
            prefills=spans,
            sample_rows=as_long(sample_rows),
            sample_request_ids=sample_ids,
            lora=lora,
        )

    def _additive(self, keep: torch.Tensor) -> torch.Tensor:
        """A bool may-attend mask as the additive float mask SDPA applies (given a bool one, torch's CPU
        kernel converts it in every call, i.e. every layer)."""
        mask = torch.zeros(keep.shape, dtype=self.cache.k.dtype, device=keep.device)
        return mask.masked_fill_(~keep, float("-inf"))

    # -- the forward -----------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Run the step; returns logits [S, vocab] (float32) of the sample rows."""
        core = self.model.model
        h = core.embed_tokens(batch.input_ids)  # [T, hidden]
        cos, sin = core.rotary_emb(h, batch.positions[None, :])  # [1, T, D] each
        cos, sin = cos[0], sin[0]
        if self.lean is not None:
            h = self._lean_layers(h, cos, sin, batch)
        else:
            for i, layer in enumerate(core.layers):
                residual = h
                x = layer.input_layernorm(h)
                h = residual + self._attention(i, layer.self_attn, x, cos, sin, batch)
                residual = h
                h = residual + self._mlp(i, layer.mlp, layer.post_attention_layernorm(h), batch.lora)
        if batch.sample_rows.numel() == 0:
            return torch.empty(0, self.model.config.vocab_size, device=self.device)
        last = core.norm(h[batch.sample_rows])  # [S, hidden]
        head = self.model.lm_head
        return self.linear(last, head.weight, head.bias).float()  # [S, vocab]

    def _lean_layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """The decoder layers on the lean path; h [T, hidden] (the embeddings, updated in place as
        the residual) -> the last layer's output, before the final norm."""
        attns = [layer.self_attn for layer in self.model.model.layers]
        layers = self.lean.layers
        x = rms_norm(h, layers[0].input_norm, layers[0].input_eps)
        for i, ly in enumerate(layers):
            x, h = add_rms_norm(self._attention(i, attns[i], x, cos, sin, batch), h, ly.post_norm, ly.post_eps)
            m = ly.mlp(x, self._lora_hook(i, batch.lora), linear=self.linear)
            if i + 1 < len(layers):  # this layer's residual add fused with the next layer's input norm
                x, h = add_rms_norm(m, h, layers[i + 1].input_norm, layers[i + 1].input_eps)
            else:  # the final norm runs on the sample rows only (forward)
                h.add_(m)
        return h

    def _mlp(self, layer_idx: int, mlp: Any, x: torch.Tensor, lora: StepLora | None) -> torch.Tensor:
        """The HF MLP module, opened up for packed weights or when the step has adapters (the deltas
        join gate, up, down)."""
        if lora is None and not self.packed:
            return mlp(x)
        gate, up = _linear(self.linear, mlp.gate_proj, x), _linear(self.linear, mlp.up_proj, x)
        if lora is not None:
            lora.add_(layer_idx, "gate_up", x, [gate, up])
        y = mlp.act_fn(gate) * up
        out = _linear(self.linear, mlp.down_proj, y)
        if lora is not None:
            lora.add_(layer_idx, "down", y, [out])
        return out

    @staticmethod
    def _lora_hook(layer_idx: int, lora: StepLora | None) -> Any:
        """For lean_llama's fused GEMMs: ``hook(group, x, outs)`` adds the deltas; None without adapters."""
        if lora is None:
            return None
        return lambda group, x, outs: lora.add_(layer_idx, group, x, outs)

    def _attention(
        self, layer_idx: int, attn: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: StepBatch
    ) -> torch.Tensor:
        t = x.shape[0]
        hq, hkv, d, g = self.num_heads, self.num_kv_heads, self.head_dim, self.groups
        if self.lean is not None:  # views of one qkv tensor (q non-contiguous: empty_like below is dense)
            q, k, v = self.lean.layers[layer_idx].qkv_rope(x, cos, sin, self._lora_hook(layer_idx, batch.lora),
                                                           linear=self.linear)
        else:
            lin = self.linear
            q, k, v = _linear(lin, attn.q_proj, x), _linear(lin, attn.k_proj, x), _linear(lin, attn.v_proj, x)
            if batch.lora is not None:
                batch.lora.add_(layer_idx, "qkv", x, [q, k, v])
            q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
            q, k = self._rope(q, k, cos, sin, unsqueeze_dim=1)  # cos/sin [T, D] -> [T, 1, D]
        self.cache.write(layer_idx, batch.write_slots, k, v)
        out = torch.empty_like(q)  # [T, Hq, D]
        scale = attn.scaling
        nd = batch.num_decodes
        if nd and self.paged_decode is not None:  # K/V read in place through the block tables, written into out
            self.paged_decode(
                q[:nd], self.cache.k[layer_idx], self.cache.v[layer_idx], batch.decode_ctx_blocks,
                batch.decode_lens, self.cache.block_size, scale, out=out[:nd],
            )  # fmt: skip
        for group in batch.decode_groups:
            b = group.gather.batch
            kc, vc = self.cache.read_blocks(layer_idx, group.gather)  # [Hkv, b, Kd, D]
            # GQA without repeating K/V: the G query heads sharing a KV head become G query rows.
            # (Hkv, b) are both batch dims to SDPA; the mask [1, b, 1, Kd] broadcasts over Hkv and G.
            qd = q[group.rows].view(b, hkv, g, d).transpose(0, 1)  # [Hkv, b, G, D]
            o = F.scaled_dot_product_attention(qd, kc, vc, attn_mask=group.mask, scale=scale)  # [Hkv, b, G, D]
            out[group.rows] = o.transpose(0, 1).reshape(b, hq, d)
        for span in batch.prefills:
            n = span.rows.stop - span.rows.start
            kc, vc = self.cache.read_blocks(layer_idx, span.gather)  # [Hkv, 1, K, D]
            qp = q[span.rows].view(n, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * n, d)
            # 4-D with a batch of 1: the shape CUDA's fused SDPA kernels take (3-D falls back to math).
            o = F.scaled_dot_product_attention(
                qp[None], kc[:, 0][None], vc[:, 0][None], attn_mask=span.mask[None, None], scale=scale
            )[0]  # [Hkv, G*n, D]
            out[span.rows] = o.view(hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, hq, d)
        o_in = out.view(t, hq * d)
        o = _linear(self.linear, attn.o_proj, o_in)
        if batch.lora is not None:
            batch.lora.add_(layer_idx, "o", o_in, [o])
        return o


def _linear(linear: Any, module: Any, x: torch.Tensor) -> torch.Tensor:
    """An HF ``nn.Linear`` module's projection through ``linear`` (``F.linear`` or ``PackedLinears``)."""
    return linear(x, module.weight, module.bias)


def split_by_length(lens: list[int], block_size: int, overhead_blocks: int) -> list[tuple[int, int]]:
    """Split ascending context lengths into contiguous groups ``[i, j)`` that each attend in one padded
    call: the least padded blocks (a group pads to its longest) plus ``overhead_blocks`` per call.
    Exact by dynamic programming; O(n^2) for n decodes, under a millisecond at the batch sizes run."""
    blocks = [-(-n // block_size) for n in lens]
    best = [0] + [0] * len(blocks)  # best[j]: least cost of rows [0, j)
    cut = [0] * (len(blocks) + 1)
    for j in range(1, len(blocks) + 1):
        best[j], cut[j] = min((best[i] + (j - i) * blocks[j - 1] + overhead_blocks, i) for i in range(j))
    groups, j = [], len(blocks)
    while j:
        groups.append((cut[j], j))
        j = cut[j]
    return groups[::-1]
