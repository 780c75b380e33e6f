"""Small LoRA adapters made by peft itself, and the reference they are checked against.

``make_adapter`` builds a peft LoRA on a copy of a base model with random factors (``init_lora_weights=
False``: peft's default zero B would make an adapter that changes nothing) and saves it the way
``chatpipe train lora`` does (``save_pretrained``: adapter_config.json + adapter_model.safetensors).
No training: the engine must apply any adapter exactly, a trained one is only a special case (the
model-version tests serve trained ones). ``merged_model`` is the reference: peft's
``merge_and_unload`` of the adapter into another copy of the base.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(base, folder: Path, seed: int, r: int = 8, alpha: int = 16,
                 targets: tuple[str, ...] = ALL_PROJECTIONS, b_scale: float = 0.5) -> Path:  # fmt: skip
    """A peft LoRA adapter of ``base`` with seeded random A and B (B times ``b_scale``) in ``folder``."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False, lora_dropout=0.0))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(b_scale)
    peft_model.save_pretrained(str(folder))
    return Path(folder)


def merged_model(base, folder: Path):
    """A copy of ``base`` with the adapter in ``folder`` merged into its weights by peft."""
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(base), str(folder)).merge_and_unload().eval()
