"""The engine's one settings object: which model, where it runs, how big the batch and KV cache are.

Built once by the CLI from flags and ``CHATPIPE_*`` environment variables (pydantic-settings does
the reading; no engine module touches ``os.environ``), then passed explicitly. Frozen.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.requests import DEFAULT_CONTEXT_TOKENS
from transport.context_settings import SHARED_CONTEXT_ENV, with_shared_context

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")  # what the engine runs on (model_store checks the GPU is there)


class EngineSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CHATPIPE_", frozen=True, extra="forbid")

    model_path: Path | None = Field(
        None, description="HF model folder or .gguf file; empty = the default model in model_cache"
    )
    model_cache: Path = Field(
        Path.home() / ".cache" / "chatpipe" / "models",
        description="Where `chatpipe model pull` puts converted models (CHATPIPE_MODEL_CACHE)",
    )
    device: str = Field("auto", description="'cpu', 'cuda', 'cuda:1', or 'auto' (cuda when available)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and KV cache dtype; auto = bfloat16 on CUDA, float32 on CPU"
    )
    max_batch: int = Field(16, ge=1, description="Most requests running at once")
    max_seq_len: int = Field(DEFAULT_CONTEXT_TOKENS, json_schema_extra=SHARED_CONTEXT_ENV, ge=2,
                             description="Most tokens (prompt + output) per request: CHATPIPE_CONTEXT_TOKENS, shared "
                                         "with streams (schemas/requests.py); CHATPIPE_MAX_SEQ_LEN is its deprecated "
                                         "alias")
    kv_cache_tokens: int = Field(16384, ge=16, description="KV cache budget in tokens, all requests together")
    kv_block_size: int = Field(16, ge=1, description="Tokens per KV cache block")
    max_step_tokens: int = Field(512, ge=1, description="Most tokens computed per step (prompt chunks + decodes)")
    max_waiting: int = Field(256, ge=0, description="Waiting-queue bound; beyond it requests are refused")
    queue_policy: Literal["fair", "priority", "fcfs"] = Field(
        "fair", description="Waiting-queue order: fair = interactive before batch, then the tenant served least "
        "(tokens / its weight, fair_queue.py), FCFS within a tenant; priority = interactive before batch, FCFS; "
        "fcfs = arrival order (CHATPIPE_QUEUE_POLICY)")
    prefix_caching: bool = Field(
        True, description="Reuse cached KV blocks of equal prompt prefixes across requests (CHATPIPE_PREFIX_CACHING)"
    )
    prefix_cache_salt: bool = Field(
        True, description="Salt prefix-cache hashes per tenant, so one tenant's blocks never serve another "
        "(false: one cache for all tenants, whose time to first token then tells a tenant what another sent; "
        "the baseline of bench/prefix_salt.py) (CHATPIPE_PREFIX_CACHE_SALT)",
    )
    kv_allocation: Literal["lazy", "reserve"] = Field(
        "lazy",
        description="lazy: KV blocks as tokens are computed, preempt when out; reserve: prompt + max_new_tokens "
        "at admission (CHATPIPE_KV_ALLOCATION)",
    )
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads; None = torch's default")
    allocator: Literal["tcmalloc", "system"] = Field(
        "tcmalloc", description="tcmalloc: a process running the engine (chatpipe inference, chatpipe generate, the "
        "benches) re-executes itself once with Debian's libtcmalloc-minimal4 preloaded where it is installed and "
        "torch's 2 MB pages on (THP_MEM_ALLOC_ENABLE) (infra/allocator.py: ~15% faster CPU steps than glibc's malloc "
        "on 4 KB pages); system: neither (CHATPIPE_ALLOCATOR)")
    compile: bool = Field(False, description="torch.compile the per-layer dense math (CUDA; unverified)")
    lean_layers: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Dense layer math through inference/engine/lean_llama.py (fused qkv and gate_up GEMMs, rotary "
        "in place, residual add fused with RMSNorm) instead of the HF modules one by one; auto = on for CUDA, and "
        "on CPU where the weights are packed (packed_linear: the fused copies then cost no memory) (CHATPIPE_LEAN_LAYERS)",
    )
    triton_interpret: bool = Field(
        False, validation_alias=AliasChoices("TRITON_INTERPRET", "triton_interpret"),
        description="Triton's own variable (Triton reads it too): 1 runs its kernels in the interpreter, which is how "
        "paged_kernel on runs on CPU tensors (the tests)")
    paged_kernel: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Decode attention by a kernel reading K/V in place through the block tables instead of a "
        "gather + SDPA: on CUDA the Triton kernel (inference/engine/kernels/paged_attention.py), on CPU the C "
        "kernel (kernels/cpu_paged_attention.py, float32, compiled once per machine with its C compiler); auto = "
        "on where it can run (CHATPIPE_PAGED_KERNEL)",
    )

    packed_linear: Literal["auto", "on", "off"] = Field(
        "auto", description="The projections through oneDNN-packed copies of their weights (inference/engine/"
        "packed_linear.py: 1.5-2.7x faster GEMMs at decode batch sizes on CPU, one more copy of the weights in "
        "memory); auto = on for CPU with a float32 model, off on CUDA and for bfloat16 (CHATPIPE_PACKED_LINEAR)")
    max_loras: int = Field(
        4, ge=1, description="LoRA adapters held in memory at once (more may be registered: loaded from disk when "
        "a request names one, the least recently used idle one leaves) (CHATPIPE_MAX_LORAS)")
    max_lora_rank: int = Field(64, ge=1, description="Largest LoRA rank an adapter may have (CHATPIPE_MAX_LORA_RANK)")

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        # max_seq_len is the one context size of streams and the engine (streams assembles up to it)
        return with_shared_context("max_seq_len", init_settings, env_settings, dotenv_settings,
                                   file_secret_settings, settings_cls)

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if not DEVICE_PATTERN.fullmatch(value):
            raise ValueError(f"{value!r} is not a device the engine runs on; use cpu, cuda, cuda:N or auto")
        return value

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.resolved_device().startswith("cuda") else "float32"

    def resolved_lean_layers(self, device_type: str, packed_linear: bool = False) -> bool:
        """Whether the engine runs the lean layers on a model whose weights are on ``device_type``
        (``packed_linear``: whether the runner packs them, resolved_packed_linear). On CPU they are on
        only with packed weights: the packed fused copies then replace the plain ones, so they cost no
        memory (lean_llama.LeanLlama.from_hf with the packer); unpacked they would hold 279 MB more for the default
        model, which the test suite's several engines per process could not spare."""
        if self.lean_layers != "auto":
            return self.lean_layers == "on"
        return device_type == "cuda" or packed_linear

    def resolved_packed_linear(self, device, dtype) -> bool:
        """Whether the runner packs the projection weights for oneDNN (a model on ``device``, ``dtype``)."""
        from inference.engine.packed_linear import packing_available

        if self.packed_linear == "off":
            return False
        if self.packed_linear == "on" and not packing_available(device, dtype):
            raise ValueError(f"packed_linear on needs a CPU float32 model and torch with oneDNN (model on "
                             f"{device}, {dtype}); use auto or off")
        return packing_available(device, dtype)

    def resolved_paged_kernel(self, device_type: str, dtype: str = "float32") -> str | None:
        """Which kernel reads the decode rows' K/V in place on ``device_type``: ``"triton"``
        (kernels/paged_attention.py: CUDA, or Triton's interpreter on CPU tensors), ``"cpu"``
        (kernels/cpu_paged_attention.py: float32, built with the machine's C compiler), or None for the
        runner's gather + SDPA."""
        from inference.engine.kernels import cpu_paged_attention
        from inference.engine.kernels.paged_attention import HAVE_TRITON

        if self.paged_kernel == "off":
            return None
        cpu_kernel = device_type == "cpu" and dtype == "float32"
        if self.paged_kernel == "auto":
            if device_type == "cuda":
                return "triton" if HAVE_TRITON else None
            return "cpu" if cpu_kernel and cpu_paged_attention.available() else None
        if device_type == "cpu" and not self.triton_interpret:
            if not cpu_kernel or not cpu_paged_attention.available():
                raise ValueError(f"paged_kernel on needs, on CPU, a float32 model ({dtype}) and the C kernel built "
                                 "(a C compiler: see the log); use auto or off")
            return "cpu"
        # CUDA, or CPU tensors through Triton's interpreter (TRITON_INTERPRET=1: the tests)
        if not HAVE_TRITON:
            raise ValueError(f"paged_kernel on needs CUDA and triton (device {device_type}, triton missing); "
                             "use auto or off")
        return "triton"

    def default_model_dir(self) -> Path:
        return self.model_cache.expanduser() / DEFAULT_MODEL_NAME
