"""A LoRA adapter as the engine holds it: read from a peft adapter folder, checked against the model.

peft saves an adapter as ``adapter_config.json`` plus ``adapter_model.safetensors`` with, per adapted
projection, ``...layers.<i>.<self_attn|mlp>.<name>.lora_A.weight`` [r, in] and ``lora_B.weight`` [out, r];
the projection then computes ``W x + scaling * B (A x)`` with ``scaling = lora_alpha / r`` (``/ sqrt(r)``
with rsLoRA). ``chatpipe train lora`` writes exactly this. The engine never merges an adapter into the
weights (the base serves other rows of the same step): ``lora_bank.py`` applies the factors per row.

What is refused, with the reason (``AdapterError``): DoRA, trained biases, ``modules_to_save`` (a whole
embedding or head per adapter), per-module rank or alpha patterns, projections the engine does not run
(anything but q/k/v/o and gate/up/down of a decoder layer), factors whose shapes do not fit the model, a
rank above ``max_rank``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from inference.engine.errors import EngineError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = ATTENTION_PROJECTIONS + MLP_PROJECTIONS
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


class AdapterError(EngineError):
    """An adapter that cannot be served: unreadable, unsupported, or not made for this model."""


@dataclass(frozen=True)
class LoraFactors:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r], the scaling already multiplied in


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    rank: int  # the largest rank of its projections
    factors: dict[tuple[int, str], LoraFactors]  # (layer index, projection name) -> A, scaled B

    @property
    def num_parameters(self) -> int:
        return sum(f.a.numel() + f.b.numel() for f in self.factors.values())


def read_adapter_config(folder: Path) -> dict[str, Any]:
    """The folder's peft config, checked for what the engine can serve (it does not read the weights)."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(f"{folder} is not a LoRA adapter folder: no {CONFIG_FILE}")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{path} is not a JSON object")
    kind = config.get("peft_type", "LORA")
    refusals = [
        (kind != "LORA", f"peft_type {kind!r} (only LORA adapters are served)"),
        (bool(config.get("use_dora")), "DoRA (use_dora) is not supported"),
        (config.get("bias", "none") != "none", f"trained biases (bias={config.get('bias')!r}) are not supported"),
        (bool(config.get("modules_to_save")), "modules_to_save (whole modules per adapter) is not supported"),
        (bool(config.get("rank_pattern")) or bool(config.get("alpha_pattern")),
         "per-module rank_pattern / alpha_pattern is not supported"),
        (bool(config.get("fan_in_fan_out")), "fan_in_fan_out (Conv1D layers) is not supported"),
    ]  # fmt: skip
    for refused, why in refusals:
        if refused:
            raise AdapterError(f"adapter {folder}: {why}")
    if not (Path(folder) / WEIGHTS_FILE).is_file():
        raise AdapterError(f"adapter {folder} has no {WEIGHTS_FILE} (only safetensors weights are read)")
    return config


def load_adapter(name: str, folder: Path, model_config: Any, dtype: torch.dtype, device: torch.device | str,
                 max_rank: int) -> LoraAdapter:  # fmt: skip
    """Read and check an adapter for a model of ``model_config``; factors in ``dtype`` on ``device``."""
    from safetensors.torch import load_file

    config = read_adapter_config(folder)
    try:
        tensors = load_file(str(Path(folder) / WEIGHTS_FILE))
    except Exception as exc:  # safetensors raises its own error types for a truncated or corrupt file
        raise AdapterError(f"adapter {folder}: {WEIGHTS_FILE} is not readable ({exc})") from exc
    alpha = float(config.get("lora_alpha", 8))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in PROJECTIONS:
            raise AdapterError(f"adapter {folder}: {key!r} is not a LoRA factor of a decoder projection "
                               f"({', '.join(PROJECTIONS)})")
        pairs.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = tensor
    if not pairs:
        raise AdapterError(f"adapter {folder}: {WEIGHTS_FILE} holds no LoRA factors")
    shapes = projection_shapes(model_config)
    factors: dict[tuple[int, str], LoraFactors] = {}
    for (layer, proj), ab in sorted(pairs.items()):
        where = f"adapter {folder}, layer {layer} {proj}"
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{where}: lora_A and lora_B must both be present")
        if not 0 <= layer < model_config.num_hidden_layers:
            raise AdapterError(f"{where}: the model has {model_config.num_hidden_layers} layers")
        a, b = ab["A"], ab["B"]
        out_features, in_features = shapes[proj]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape != (out_features, r):
            raise AdapterError(f"{where}: factors {tuple(a.shape)} and {tuple(b.shape)} do not fit the model's "
                               f"[{out_features}, {in_features}] projection (another base model?)")
        if r > max_rank:
            raise AdapterError(f"{where}: rank {r} is above the engine's max_lora_rank {max_rank}")
        scaling = alpha / (r**0.5 if config.get("use_rslora") else r)
        # Scaled in float32, then cast: B's scaling is folded in once here, not per step.
        factors[(layer, proj)] = LoraFactors(
            a=a.to(device=device, dtype=dtype).contiguous(),
            b=(b.float() * scaling).to(device=device, dtype=dtype).contiguous(),
        )
    return LoraAdapter(name=name, rank=max(f.a.shape[0] for f in factors.values()), factors=factors)


def projection_shapes(model_config: Any) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each projection of a Llama-family decoder layer."""
    hidden, inter = model_config.hidden_size, model_config.intermediate_size
    head_dim = getattr(model_config, "head_dim", None) or hidden // model_config.num_attention_heads
    q, kv = model_config.num_attention_heads * head_dim, model_config.num_key_value_heads * head_dim
    return {
        "q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
        "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter),
    }  # fmt: skip
