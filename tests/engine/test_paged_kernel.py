"""The Triton paged decode-attention kernel (inference/engine/kernels) against its torch reference
and against the SDPA decode path of ``ModelRunner._attention``.

How the kernels run without a GPU: in Triton's interpreter, in a child process. Triton reads
``TRITON_INTERPRET`` (``triton.knobs.runtime.interpret``, looked up in ``os.environ`` on each
access) inside ``triton.jit`` *at decoration time*: it then returns an ``InterpretedFunction``
instead of a ``JITFunction`` (``runtime/jit.py``, ``jit``), and launching never checks again.
Decoration happens twice: for our kernels when ``paged_attention.py`` is first imported, and for
Triton's own ``@jit`` library functions (``tl.zeros`` among them) when ``triton.language`` is
first imported. So setting ``os.environ`` at the top of this module works only if nothing in
the pytest process imported triton or the kernels module before (torch.compile, transformers or
a later ``model_runner`` import all may), and it would leak the interpreter into every test
collected after. Swapping in ``InterpretedFunction(kernel.fn)`` was tried and fails for that
second reason (``tl.zeros`` stays compiled: "Cannot call @triton.jit'd outside of the scope of a
kernel"). A child process started with ``TRITON_INTERPRET=1`` has neither problem: the fixture
runs this file as a script once per module (``python test_paged_kernel.py``), which computes
every case and prints one JSON result per case; each case is then its own parametrized test
here. The same script compiles the kernels for real on a GPU: ``python
tests/engine/test_paged_kernel.py --device cuda`` (no ``TRITON_INTERPRET``).

The kernel's oracle, ``paged_decode_attention_reference`` (plain torch, here), is also checked in
this process against the SDPA decode path (the runner's CPU path), without triton.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # run as the child script: make `inference` importable from the checkout
    sys.path.insert(0, str(ROOT))

from inference.engine.kernels import cpu_paged_attention as cpa  # noqa: E402 - sys.path set above when run as the child script
from inference.engine.kernels import paged_attention as pa  # noqa: E402 - sys.path set above when run as the child script
from inference.engine.kv_cache import PagedKVCache  # noqa: E402 - sys.path set above when run as the child script

F32_TOL = dict(atol=1e-5, rtol=1e-5)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)
SMOL = dict(hq=9, hkv=3, d=64)  # SmolLM2-135M
LLAMA8B = dict(hq=32, hkv=8, d=128)  # Llama-3-8B's attention heads


def context_lens_for(bs: int) -> list[int]:
    """The edge lengths around one block, a few hundred, and a padding row of context 0."""
    return [1, bs - 1, bs, bs + 1, 300, 0]


def make_tables(lens: list[int], bs: int, num_blocks: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Random non-contiguous block ids per row; rows 1-3 share their first block (a cached prefix);
    the context-0 row's table is all scratch block 0. Width: the longest context's blocks + 1 (stale tail)."""
    width = -(-max(lens) // bs) + 1
    rows = [torch.randperm(num_blocks - 1, generator=gen)[:width] + 1 for _ in lens]  # block 0 = scratch
    for r in range(2, min(4, len(lens))):
        rows[r][0] = rows[1][0]
    for r, n in enumerate(lens):
        if n == 0:
            rows[r].zero_()
    return torch.stack(rows).to(dtype)


def decode_inputs(hq, hkv, d, bs, dtype, seed, lens=None, table_dtype=torch.int32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    lens = lens if lens is not None else context_lens_for(bs)
    num_blocks = 2 * (-(-max(lens) // bs)) + 8
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)
    k_pool, v_pool = rnd(hkv, num_blocks * bs, d), rnd(hkv, num_blocks * bs, d)
    q = rnd(len(lens), hq, d)
    tables = make_tables(lens, bs, num_blocks, gen, table_dtype)
    to = lambda t: t.to(device)
    return to(q), to(k_pool), to(v_pool), to(tables), torch.tensor(lens, device=device), d**-0.5


def sdpa_decode_path(cache: PagedKVCache, layer: int, q, tables, lens: list[int], scale: float) -> torch.Tensor:
    """ModelRunner._attention's decode branch with the decodes in one group (prepare()'s table width and mask)."""
    nd, hq, d = q.shape
    hkv, g, bs = cache.k.shape[1], hq // cache.k.shape[1], cache.block_size
    decode_ctx = tables[:, : -(-max(lens) // bs)].long()  # DeviceBlockTables.gather's width
    kd = decode_ctx.shape[1] * bs
    decode_mask = (torch.arange(kd, device=q.device)[None, :] < torch.tensor(lens, device=q.device)[:, None])[:, None, None, :]
    kc, vc = cache.read_blocks(layer, cache.block_gather(decode_ctx))  # [Hkv, Bd, Kd, D]
    qd = q.view(nd, hkv, g, d).transpose(0, 1)  # [Hkv, Bd, G, D]
    o = F.scaled_dot_product_attention(qd, kc, vc, attn_mask=decode_mask.view(1, nd, 1, -1), scale=scale)
    return o.transpose(0, 1).reshape(nd, hq, d)


def paged_decode_attention_reference(q, k_pool, v_pool, block_tables, context_lens, block_size: int,
                                     scale: float) -> torch.Tensor:
    """What ``paged_decode_attention`` computes, by gathering whole blocks (as ``read_blocks``) and a
    masked softmax in float32; output in q's dtype, rows of context 0 are zeros. The kernel's oracle."""
    b, hq, hkv, d = pa.check_decode_args(q, k_pool, v_pool, block_tables, context_lens, block_size)
    g = hq // hkv
    out = torch.zeros_like(q)
    max_len = int(context_lens.max()) if b else 0
    if max_len == 0:
        return out
    nblocks = -(-max_len // block_size)
    flat = block_tables[:, :nblocks].reshape(-1).long()
    kv = []
    for pool in (k_pool, v_pool):
        rows = pool.reshape(hkv, -1, block_size * d)  # [Hkv, blocks, bs*D]
        kv.append(rows.index_select(1, flat).view(hkv, b, nblocks * block_size, d).float())
    kc, vc = kv  # [Hkv, B, K, D]
    qg = q.float().view(b, hkv, g, d).transpose(0, 1)  # [Hkv, B, G, D]
    scores = (qg @ kc.transpose(-1, -2)) * scale  # [Hkv, B, G, K]
    valid = torch.arange(nblocks * block_size, device=q.device)[None, :] < context_lens[:, None]  # [B, K]
    scores = scores.masked_fill(~valid[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # context 0: all -inf -> NaN -> 0
    o = probs @ vc  # [Hkv, B, G, D]
    return o.transpose(0, 1).reshape(b, hq, d).to(q.dtype)

def filled_cache(hq, hkv, d, bs, dtype, seed, lens, device):
    """A 2-layer PagedKVCache whose layer 1 got every row's K/V through PagedKVCache.write (distinct slots)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 2 * (-(-max(lens) // bs)) + 8
    cache = PagedKVCache(2, num_blocks, bs, hkv, d, dtype, device)
    tables = make_tables(lens, bs, num_blocks, gen, torch.int64).to(device)
    pos = [torch.arange(n, device=device) for n in lens]
    # Every slot a row reads, written once: rows sharing a prefix block read the same K/V.
    slots = torch.cat([tables[r, p // bs] * bs + p % bs for r, p in enumerate(pos)]).unique()
    k = torch.randn(len(slots), hkv, d, generator=gen).to(dtype).to(device)
    v = torch.randn(len(slots), hkv, d, generator=gen).to(dtype).to(device)
    cache.write(1, slots, k, v)
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype).to(device)
    return cache, q, tables, k, v, slots


# -- the cases (computed in the child) -------------------------------------------------------------


def case_decode(heads, dtype, bs, seed, table_dtype=torch.int32, strided_q=False, device="cpu", kernel_module=pa):
    q, kp, vp, tables, lens, scale = decode_inputs(**heads, bs=bs, dtype=dtype, seed=seed, table_dtype=table_dtype, device=device)
    if strided_q:  # q as a slice of a fused qkv-like buffer: non-contiguous rows
        buf = torch.zeros(q.shape[0], q.shape[1], 3 * q.shape[2], dtype=dtype, device=device)
        buf[:, :, q.shape[2] : 2 * q.shape[2]] = q
        q = buf[:, :, q.shape[2] : 2 * q.shape[2]]
    out = kernel_module.paged_decode_attention(q, kp, vp, tables, lens, bs, scale)
    ref = paged_decode_attention_reference(q, kp, vp, tables, lens, bs, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    zero_rows = lens == 0
    assert torch.equal(out[zero_rows], torch.zeros_like(out[zero_rows])), "context-0 rows must be zeros"
    torch.testing.assert_close(out.float(), ref.float(), **(F32_TOL if dtype == torch.float32 else BF16_TOL))
    return (out.float() - ref.float()).abs().max().item()


def case_matches_sdpa(heads, dtype, bs, seed, device="cpu", kernel_module=pa):
    lens = [1, bs - 1, bs + 1, 2 * bs, 137]  # decode rows always attend to >= 1 token
    cache, q, tables, _, _, _ = filled_cache(**heads, bs=bs, dtype=dtype, seed=seed, lens=lens, device=device)
    scale = heads["d"] ** -0.5
    want = sdpa_decode_path(cache, 1, q, tables, lens, scale)
    # into a slice of a bigger output buffer, as the runner would (out[:nd] of its [T, Hq, D])
    buf = torch.full((len(lens) + 2, *q.shape[1:]), float("nan"), dtype=dtype, device=device)
    got = kernel_module.paged_decode_attention(q, cache.k[1], cache.v[1], tables, torch.tensor(lens, device=device), bs, scale, out=buf[: len(lens)])
    assert got.data_ptr() == buf.data_ptr() and buf[len(lens) :].isnan().all()
    torch.testing.assert_close(got.float(), want.float(), **(F32_TOL if dtype == torch.float32 else BF16_TOL))
    return (got.float() - want.float()).abs().max().item()


def case_engine_greedy_equals_hf(bs, lean, device="cpu", kernel_module=pa, paged_kernel="on"):
    """The whole engine with a kernel in the decode branch (EngineSettings.paged_kernel on; the C kernel
    when ``kernel_module`` is cpu_paged_attention, gather + SDPA with ``paged_kernel="off"``): greedy
    outputs of a tiny random Llama equal HF ``generate``, prompts staggered over chunked steps."""
    from inference.engine.engine import Engine
    from inference.engine.request import SamplingParams
    from inference.engine.settings import EngineSettings
    from tests.engine.conftest import hf_greedy, make_tiny_model

    calls = []
    kernel = kernel_module.paged_decode_attention
    kernel_module.paged_decode_attention = lambda *a, **k: (calls.append(1), kernel(*a, **k))[1]
    try:
        model = make_tiny_model()
        g = torch.Generator().manual_seed(5)
        prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (2, 3, 11, 40)]
        engine = Engine(model, EngineSettings(device="cpu", dtype="float32", kv_cache_tokens=2048, kv_block_size=bs,
                                              max_step_tokens=5, max_batch=4, paged_kernel=paged_kernel,
                                              lean_layers="on" if lean else "off"))
        assert (engine.runner.paged_decode is not None) == (paged_kernel == "on")
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
    finally:
        kernel_module.paged_decode_attention = kernel
    assert bool(calls) == (paged_kernel == "on"), f"the decode branch called the kernel {len(calls)} times"
    want = [hf_greedy(model, p, 8) for p in prompts]
    assert outs == want, f"engine {outs} != HF generate {want}"
    return 0.0


F32, BF16 = torch.float32, torch.bfloat16
CASES = {
    "engine-greedy-bs3": (case_engine_greedy_equals_hf, dict(bs=3, lean=False)),
    "engine-greedy-bs16-lean": (case_engine_greedy_equals_hf, dict(bs=16, lean=True)),
    "smol-f32-bs16": (case_decode, dict(heads=SMOL, dtype=F32, bs=16, seed=1)),
    "smol-bf16-bs16": (case_decode, dict(heads=SMOL, dtype=BF16, bs=16, seed=2)),
    "llama8b-f32-bs16": (case_decode, dict(heads=LLAMA8B, dtype=F32, bs=16, seed=3)),
    "llama8b-bf16-bs16": (case_decode, dict(heads=LLAMA8B, dtype=BF16, bs=16, seed=4)),
    "smol-f32-bs4-int64-table": (case_decode, dict(heads=SMOL, dtype=F32, bs=4, seed=5, table_dtype=torch.int64)),
    "smol-f32-bs32": (case_decode, dict(heads=SMOL, dtype=F32, bs=32, seed=6)),
    "smol-bf16-bs128": (case_decode, dict(heads=SMOL, dtype=BF16, bs=128, seed=7)),
    "smol-f32-bs8-strided-q": (case_decode, dict(heads=SMOL, dtype=F32, bs=8, seed=8, strided_q=True)),
    "smol-f32-bs3": (case_decode, dict(heads=SMOL, dtype=F32, bs=3, seed=14)),  # the engine tests' odd size
    "sdpa-path-smol-f32-bs16": (case_matches_sdpa, dict(heads=SMOL, dtype=F32, bs=16, seed=9)),
    "sdpa-path-llama8b-bf16-bs16": (case_matches_sdpa, dict(heads=LLAMA8B, dtype=BF16, bs=16, seed=10)),
    "sdpa-path-smol-f32-bs4": (case_matches_sdpa, dict(heads=SMOL, dtype=F32, bs=4, seed=11)),
}


def run_cases(device: str) -> dict[str, dict]:
    results = {}
    for name, (fn, kwargs) in CASES.items():
        if fn is case_engine_greedy_equals_hf and device != "cpu":  # on CUDA: bench/gpu_exactness.py, real shapes
            results[name] = dict(max_abs_err=None, failure=None, seconds=0.0, skipped="see bench/gpu_exactness.py")
            continue
        t0 = time.perf_counter()
        try:
            err, failure = fn(**kwargs, device=device), None
        except Exception as e:  # noqa: BLE001 - reported per case by the parent, which fails that case's test
            err, failure = None, f"{type(e).__name__}: {e}"
        results[name] = dict(max_abs_err=err, failure=failure, seconds=round(time.perf_counter() - t0, 2))
    return results


# -- the tests (parent process) ---------------------------------------------------------------------

if __name__ != "__main__":
    import pytest

    requires_triton = pytest.mark.skipif(
        importlib.util.find_spec("triton") is None,
        reason="triton is not installed (CPU-only torch build): the Triton kernels cannot run, not even interpreted",
    )

    @pytest.fixture(scope="module")
    def interpreted_results():
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--device", "cpu"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert proc.returncode == 0, f"interpreter child exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        return json.loads(proc.stdout.strip().splitlines()[-1])

    @requires_triton
    @pytest.mark.parametrize("name", list(CASES))
    def test_kernel_in_interpreter(interpreted_results, name):
        res = interpreted_results[name]
        assert res["failure"] is None, res["failure"]

    @pytest.mark.parametrize("dtype", [F32, BF16])
    def test_reference_matches_sdpa_decode_path(dtype):
        """The reference equals the runner's gather + SDPA, its CPU path (in this process, no triton)."""
        heads, bs, lens = LLAMA8B, 16, [1, 15, 16, 17, 300]
        cache, q, tables, _, _, _ = filled_cache(**heads, bs=bs, dtype=dtype, seed=21, lens=lens, device="cpu")
        scale = heads["d"] ** -0.5
        want = sdpa_decode_path(cache, 1, q, tables, lens, scale)
        got = paged_decode_attention_reference(q, cache.k[1], cache.v[1], tables, torch.tensor(lens), bs, scale)
        torch.testing.assert_close(got.float(), want.float(), **(F32_TOL if dtype == F32 else BF16_TOL))

    def test_reference_context_zero_rows_are_zeros():
        q, kp, vp, tables, lens, scale = decode_inputs(**SMOL, bs=16, dtype=F32, seed=22, lens=[0, 5, 0])
        out = paged_decode_attention_reference(q, kp, vp, tables, lens, 16, scale)
        assert torch.equal(out[[0, 2]], torch.zeros_like(out[[0, 2]])) and out[1].abs().sum() > 0
        none = paged_decode_attention_reference(q, kp, vp, tables, torch.zeros(3, dtype=torch.long), 16, scale)
        assert torch.equal(none, torch.zeros_like(q))

    def test_paged_kernel_setting_resolves_per_device(monkeypatch):
        from inference.engine.settings import EngineSettings

        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        auto, on, off = (EngineSettings(paged_kernel=v) for v in ("auto", "on", "off"))
        monkeypatch.setattr(pa, "HAVE_TRITON", True)
        assert auto.resolved_paged_kernel("cuda") == on.resolved_paged_kernel("cuda") == "triton"
        assert auto.resolved_paged_kernel("cpu") == on.resolved_paged_kernel("cpu") == "cpu"  # the C kernel
        assert off.resolved_paged_kernel("cuda") is None and off.resolved_paged_kernel("cpu") is None
        assert auto.resolved_paged_kernel("cpu", "bfloat16") is None  # the C kernel is float32 only
        with pytest.raises(ValueError, match="float32"):
            on.resolved_paged_kernel("cpu", "bfloat16")
        monkeypatch.setattr(cpa, "_library", lambda: None)  # no C compiler: auto keeps gather + SDPA
        assert auto.resolved_paged_kernel("cpu") is None
        with pytest.raises(ValueError, match="C kernel built"):
            on.resolved_paged_kernel("cpu")
        monkeypatch.setattr(pa, "HAVE_TRITON", False)  # a CUDA build without triton: auto falls back to SDPA
        assert auto.resolved_paged_kernel("cuda") is None
        with pytest.raises(ValueError, match="triton missing"):
            on.resolved_paged_kernel("cuda")

    # -- the C kernel for CPU (kernels/cpu_paged_attention.py), in this process ------------------------
    # It needs a C compiler, which `make setup` checks for (a machine without one keeps gather + SDPA:
    # the resolution test above); here a missing compiler fails these tests rather than skipping them.

    @pytest.mark.parametrize("heads, bs, table_dtype, strided_q", [
        (SMOL, 16, torch.int32, False), (SMOL, 3, torch.int64, False), (SMOL, 32, torch.int32, True),
        (LLAMA8B, 16, torch.int64, False), (dict(hq=4, hkv=2, d=40), 8, torch.int32, False),  # a head dim not /16
    ])  # fmt: skip
    def test_cpu_kernel_matches_reference(heads, bs, table_dtype, strided_q):
        err = case_decode(heads, F32, bs, seed=31, table_dtype=table_dtype, strided_q=strided_q, kernel_module=cpa)
        assert err < 1e-5

    @pytest.mark.parametrize("heads, bs", [(SMOL, 16), (LLAMA8B, 4)])
    def test_cpu_kernel_matches_the_sdpa_decode_path_into_an_output_slice(heads, bs):
        assert case_matches_sdpa(heads, F32, bs, seed=32, kernel_module=cpa) < 1e-5

    @pytest.mark.parametrize("paged_kernel, bs", [("on", 3), ("on", 16), ("off", 3)])
    def test_engine_greedy_equals_hf_with_the_cpu_kernel_and_without(paged_kernel, bs):
        case_engine_greedy_equals_hf(bs, lean=False, kernel_module=cpa, paged_kernel=paged_kernel)

    def test_cpu_kernel_refuses_what_it_does_not_run():
        q, kp, vp, tables, lens, scale = decode_inputs(**SMOL, bs=16, dtype=BF16, seed=33, lens=[3, 5])
        with pytest.raises(ValueError, match="float32"):
            cpa.paged_decode_attention(q, kp, vp, tables, lens, 16, scale)
        with pytest.raises(ValueError, match="multiple"):
            cpa.paged_decode_attention(q.float()[:, :8], kp.float(), vp.float(), tables, lens, 16, scale)

    @pytest.mark.parametrize("lens, want", [
        ([5, 6, 7], [(0, 3)]),  # one block each: one call
        ([16, 16, 500, 510], [(0, 2), (2, 4)]),  # two far apart lengths: two calls beat padding 1 to 32 blocks
        ([1] * 3 + [400], [(0, 3), (3, 4)]),
        ([], []),
    ])  # fmt: skip
    def test_decodes_split_by_length(lens, want):
        from inference.engine.model_runner import split_by_length

        assert split_by_length(lens, 16, 12) == want

    def test_bad_shapes_are_refused():
        q, kp, vp, tables, lens, scale = decode_inputs(**SMOL, bs=16, dtype=F32, seed=23, lens=[3])
        with pytest.raises(ValueError, match="block_size 0"):
            paged_decode_attention_reference(q, kp, vp, tables, lens, 0, scale)
        with pytest.raises(ValueError, match="multiple"):
            paged_decode_attention_reference(q[:, :8], kp, vp, tables, lens, 16, scale)


if __name__ == "__main__":
    # The child: `--device cpu` under TRITON_INTERPRET=1 (the tests), or `--device cuda` compiled.
    device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("CPU tensors need Triton's interpreter: run with TRITON_INTERPRET=1")
    results = run_cases(device)
    for name, res in results.items():
        print(f"# {name}: {res}", file=sys.stderr)
    print(json.dumps(results))
    if device != "cpu" and any(r["failure"] for r in results.values()):  # bench/gpu_check.sh's "kernel" part
        sys.exit("paged kernel differs from the reference on " + device)
