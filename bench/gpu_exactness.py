"""Engine greedy output == HF ``generate`` greedy output, token for token, on a device.

The CPU test suite proves this (tests/engine); this script is the same check for the CUDA path,
which CI cannot run. A random-init float32 Llama (float32 so that batching does not change
greedy picks) answers prompts that share a long system prefix (prefix-cache hits), in a KV pool
small enough to force preemption, and each answer is compared with HF ``generate`` of the same
prompt alone.

    python bench/gpu_exactness.py --device cuda      # part of bench/gpu_check.sh run
    python bench/gpu_exactness.py --device cpu       # the same check here (about 20 s)

Last line: ``gpu_exactness: N/N answers identical`` (exit 1 on any difference).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=24)
    args = ap.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM

    from inference.engine.engine import Engine
    from inference.engine.request import SamplingParams
    from inference.engine.settings import EngineSettings

    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=4096, max_position_embeddings=2048, rope_theta=500000.0)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM._from_config(cfg, dtype=torch.float32).eval()

    rng = random.Random(0)
    system = [rng.randrange(10, cfg.vocab_size) for _ in range(100)]  # shared: full blocks hit the prefix cache
    prompts = [system + [rng.randrange(10, cfg.vocab_size) for _ in range(rng.randrange(5, 60))] for _ in range(args.requests)]
    longest = max(map(len, prompts)) + args.new_tokens
    # A pool of about 3 requests' worth for up to 8 at once: lazy allocation must preempt and recompute.
    settings = EngineSettings(device=args.device, max_batch=8, max_seq_len=longest, max_waiting=len(prompts),
                              kv_cache_tokens=3 * longest, max_step_tokens=256)  # fmt: skip
    engine = Engine(model, settings)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True, temperature=0.0)
    got = engine.generate(prompts[:2], params)  # fills the prefix cache
    got += engine.generate(prompts[2:], params)
    stats = engine.stats()

    gen_cfg = model.generation_config.__class__.from_dict(model.generation_config.to_dict())
    gen_cfg.eos_token_id, gen_cfg.pad_token_id, gen_cfg.do_sample = None, 0, False
    gen_cfg.max_new_tokens = args.new_tokens
    same = 0
    for i, (prompt, out) in enumerate(zip(prompts, got)):
        with torch.inference_mode():
            ref = model.generate(input_ids=torch.tensor([prompt], device=args.device), generation_config=gen_cfg)
        want = ref[0, len(prompt) :].tolist()
        if want == out:
            same += 1
        else:
            at = next((k for k, (a, b) in enumerate(zip(want, out)) if a != b), min(len(want), len(out)))
            print(f"request {i}: differs at output token {at}: engine {out[at:at + 5]} vs generate {want[at:at + 5]}")
    name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    print(f"device {name}; prefix-cache hit tokens {stats.prefix_cache_hit_tokens}, preemptions {stats.preemptions}")
    print(f"gpu_exactness: {same}/{len(prompts)} answers identical")
    sys.exit(0 if same == len(prompts) else 1)


if __name__ == "__main__":
    main()
