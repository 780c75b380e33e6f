"""The lean layers (inference/engine/lean_llama.py) against the Hugging Face modules they replace.

(a) Per layer: norms, qkv + rotary, MLP and a whole decoder layer give the HF modules' output on
the same inputs, float32 within a tight tolerance and bfloat16 within bfloat16's, for a layer of
the real SmolLM2 and of a tiny random qwen2 (q/k/v biases). (b) The engine with lean layers on
gives Hugging Face ``generate``'s greedy tokens: the tiny qwen2, and the real SmolLM2 on prompts
of very different lengths sharing the batch with chunked prefill.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from inference.engine.engine import Engine
from inference.engine.kv_cache import PagedKVCache
from inference.engine.lean_llama import LeanLayer, LeanLlama, add_rms_norm, rms_norm
from inference.engine.model_runner import ModelRunner
from inference.engine.request import Request, SamplingParams
from inference.engine.scheduler import ScheduledChunk
from inference.engine.settings import EngineSettings
from inference.engine.text import encode_prompt
from tests.engine.conftest import hf_greedy
from tests.engine.test_engine_matches_hf import QUESTIONS

# float32: a few ulps of the values (~1..100) a layer sees; bfloat16: torch's default for bf16.
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def make_tiny_qwen2(seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, use_sliding_window=False,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # HF's init zeroes biases: make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module")
def tiny_qwen2():
    return make_tiny_qwen2()


def _layer_case(model, dtype: torch.dtype, t: int = 11, layer_idx: int = 1, seed: int = 0):
    """One HF decoder layer in ``dtype`` (a copy), its lean twin, and inputs: hidden [T, H], cos/sin [T, D]."""
    cfg = model.config
    layer = copy.deepcopy(model.model.layers[layer_idx]).to(dtype)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    lean = LeanLayer.from_hf(layer, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim)
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(t, cfg.hidden_size, generator=g).to(dtype)
    positions = torch.arange(5, 5 + t)  # not from 0: rotary must use each row's own position
    cos, sin = model.model.rotary_emb(h, positions[None])
    return layer, lean, h, cos[0], sin[0]


MODELS = [pytest.param("tiny_qwen2", id="qwen2-tiny"), pytest.param("smollm2", id="smollm2", marks=pytest.mark.model)]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


@pytest.fixture
def model_of(request):
    def get(name):
        return request.getfixturevalue("tiny_qwen2") if name == "tiny_qwen2" else request.getfixturevalue("default_model")[0]

    return get


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", MODELS)
def test_lean_parts_equal_hf_modules(model_of, name, dtype):
    """Guards against a fused part not computing its HF modules' math: RMSNorm, residual add +
    RMSNorm, q/k/v projections (with qwen2's biases) + rotary, and the MLP."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = model_of(name)
    layer, lean, h, cos, sin = _layer_case(model, dtype)
    tol = TOLERANCE[dtype]
    attn, t = layer.self_attn, h.shape[0]
    with torch.inference_mode():
        x = layer.input_layernorm(h)
        torch.testing.assert_close(rms_norm(h, lean.input_norm, lean.input_eps), x, **tol)

        q, k, v = lean.qkv_rope(x, cos, sin)
        hq, hkv, d = lean.num_heads, lean.num_kv_heads, lean.head_dim
        q_ref, k_ref = apply_rotary_pos_emb(
            attn.q_proj(x).view(t, hq, d), attn.k_proj(x).view(t, hkv, d), cos, sin, unsqueeze_dim=1
        )
        torch.testing.assert_close(q, q_ref, **tol)
        torch.testing.assert_close(k, k_ref, **tol)
        torch.testing.assert_close(v, attn.v_proj(x).view(t, hkv, d), **tol)

        a = torch.randn(h.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
        normed, residual = add_rms_norm(a, h.clone(), lean.post_norm, lean.post_eps)
        torch.testing.assert_close(residual, h + a, rtol=0, atol=0)  # an add: exact in any dtype
        torch.testing.assert_close(normed, layer.post_attention_layernorm(h + a), **tol)

        torch.testing.assert_close(lean.mlp(normed), layer.mlp(normed), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", MODELS)
def test_lean_decoder_layer_equals_hf_layer(model_of, name, dtype):
    """Guards against the lean parts composing differently from HF's decoder layer (order of the
    residual adds and norms): a whole layer over a causal prompt, with plain SDPA for attention."""
    model = model_of(name)
    layer, lean, h, cos, sin = _layer_case(model, dtype)
    attn, t = layer.self_attn, h.shape[0]
    with torch.inference_mode():
        ref = layer(h[None], position_embeddings=(cos[None], sin[None]))
        ref = (ref[0] if isinstance(ref, tuple) else ref)[0]  # [T, H]

        x = rms_norm(h, lean.input_norm, lean.input_eps)
        q, k, v = lean.qkv_rope(x, cos, sin)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=attn.scaling, enable_gqa=True
        )  # [H, T, D]
        a = attn.o_proj(o.transpose(0, 1).reshape(t, -1))
        x, residual = add_rms_norm(a, h.clone(), lean.post_norm, lean.post_eps)
        out = residual + lean.mlp(x)
    torch.testing.assert_close(out, ref, **TOLERANCE[dtype])


def test_lean_layers_setting_resolves_per_device():
    """Guards against auto turning the lean layers on for an unpacked CPU model (there each engine's fused
    copies would cost ~0.3 GB, which the test suite's engines on a 24 GiB machine could not afford) or
    off where the weights are packed (they cost nothing there and are faster; docs/engine.md)."""
    assert EngineSettings().resolved_lean_layers("cuda") is True
    assert EngineSettings().resolved_lean_layers("cpu") is False
    assert EngineSettings().resolved_lean_layers("cpu", packed_linear=True) is True
    assert EngineSettings(lean_layers="on").resolved_lean_layers("cpu") is True
    assert EngineSettings(lean_layers="off").resolved_lean_layers("cpu", packed_linear=True) is False
    assert EngineSettings(lean_layers="off").resolved_lean_layers("cuda") is False


def test_packed_lean_layers_hold_no_fused_copies(default_model):
    """Guards against the packed lean path keeping the plain fused weights (279 MB for this model) beside
    their packed copies: each layer keeps empty stand-ins, the packed copies answer for them, and
    its GEMMs equal the unpacked lean layer's within oneDNN's summation order."""
    from inference.engine.packed_linear import PackedLinears, packing_available

    model, _ = default_model
    if not packing_available(torch.device("cpu"), torch.float32):
        pytest.skip("this torch has no oneDNN (mkldnn) CPU backend")
    packed = PackedLinears([], batch_hint=8)
    lean = LeanLlama.from_hf(model, packed)
    plain = LeanLlama.from_hf(model)
    for layer in lean.layers:
        assert layer.qkv_weight.numel() == 0 and layer.gate_up_weight.numel() == 0
    x = torch.randn(5, model.config.hidden_size)
    torch.testing.assert_close(lean.layers[3].mlp(x, linear=packed), plain.layers[3].mlp(x), rtol=1e-3, atol=1e-3)
    with pytest.raises(RuntimeError, match="size mismatch|cannot be multiplied"):  # the stand-in alone has nothing to multiply
        lean.layers[3].mlp(x)


def test_tiny_qwen2_ragged_steps_logits_equal_hf_path_and_hf_forward(tiny_qwen2):
    """Guards against the lean path breaking the ragged step on a model with q/k/v biases: a
    prompt chunk, then a step mixing a decode with the rest of a chunked prompt (strided q/k/v
    views written to the paged cache, read back by both attention branches), give the logits of
    the HF-module path and of HF's own forward over the whole sequence."""
    cfg = tiny_qwen2.config
    runners = {}
    for lean in (False, True):
        cache = PagedKVCache(cfg.num_hidden_layers, 32, 4, cfg.num_key_value_heads, 16, torch.float32, "cpu")
        runners[lean] = ModelRunner(tiny_qwen2, cache, lean=lean)
    g = torch.Generator().manual_seed(3)
    a = Request("a", torch.randint(0, 256, (9,), generator=g).tolist(), SamplingParams())
    b = Request("b", torch.randint(0, 256, (22,), generator=g).tolist(), SamplingParams())
    tables = {"a": [0, 1, 2, 3], "b": [7, 5, 9, 11, 13, 6]}  # out of order, as the allocator may give
    steps = [
        [ScheduledChunk(a, 0, 9, True), ScheduledChunk(b, 0, 6, False)],
        [ScheduledChunk(a, 9, 1, True), ScheduledChunk(b, 6, 16, True)],  # decode first, as the scheduler orders
    ]
    for i, chunks in enumerate(steps):
        logits = {lean: r.forward(r.prepare(chunks, tables)) for lean, r in runners.items()}
        torch.testing.assert_close(logits[True], logits[False], **TOLERANCE[torch.float32])
        if i == 0:
            a.output_token_ids.append(int(logits[True][0].argmax()))
    with torch.inference_mode():
        ref = [tiny_qwen2(torch.tensor([r.prompt_token_ids + r.output_token_ids])).logits[0, -1] for r in (a, b)]
    torch.testing.assert_close(logits[True], torch.stack(ref), **TOLERANCE[torch.float32])


def test_tiny_qwen2_engine_with_lean_layers_equals_hf_generate(tiny_qwen2):
    """Guards against the lean path breaking the ragged step (decodes and prompt chunks in one
    step, strided q/k/v views into the cache) on a model with q/k/v biases."""
    settings = EngineSettings(device="cpu", dtype="float32", kv_cache_tokens=1024, kv_block_size=4, max_step_tokens=24,
                              max_batch=4, lean_layers="on")  # fmt: skip
    engine = Engine(tiny_qwen2, settings)
    assert engine.runner.lean is not None
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 40, 13, 2)]
    params = SamplingParams(max_new_tokens=12)
    outs = engine.generate(prompts, params)
    assert outs == [hf_greedy(tiny_qwen2, p, params.max_new_tokens) for p in prompts]


@pytest.mark.model
@pytest.mark.parametrize("lean", ["on", "off"])
def test_smollm2_engine_with_lean_layers_equals_hf_generate(default_model, lean):
    """Guards against the fused GEMMs or the fused norms changing a greedy token of the real model:
    the prompts of test_engine_matches_hf.py (31 to 364 tokens; the long one prefilled in chunks
    while the others decode), staggered into a running batch, against HF ``generate`` alone. With
    lean off (the HF modules, the reference path and the CPU default) the same must hold."""
    model, tokenizer = default_model
    settings = EngineSettings(device="cpu", dtype="float32", max_batch=4, max_step_tokens=96, kv_block_size=16,
                              kv_cache_tokens=2048, lean_layers=lean)  # fmt: skip
    engine = Engine(model, settings)
    assert (engine.runner.lean is not None) == (lean == "on")
    prompts = [encode_prompt(tokenizer, q) for q in QUESTIONS[:3]]  # 31, 37 and 364 tokens
    params = SamplingParams(max_new_tokens=16)
    reqs = []
    for p in prompts:  # a new arrival every second step
        reqs.append(engine.add_request(p, params)[1])
        engine.step()
        engine.step()
    while engine.has_work():
        engine.step()
    eos = model.generation_config.eos_token_id
    for p, r in zip(prompts, reqs):
        assert r.output_token_ids == hf_greedy(model, p, params.max_new_tokens, eos=eos), tokenizer.decode(p)
