"""The vLLM engine (``inference/vllm_engine``) against ours, on the real default model, fp32, CPU.

vLLM runs in its own environment (``infra/vllm_env.py``, made by `make test`'s prerequisites), so
its side runs in a child process of that environment's Python and prints its token ids as JSON. A
missing environment fails these tests (naming `make setup-vllm`), it does not skip them.

Guards against: a vLLM path that answers other tokens than ours for the same greedy request (a
sampling field mapped wrong, a prompt handed over wrong, a stop ending one token late).
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import pytest

from infra.vllm_env import process_env, vllm_env

pytestmark = [pytest.mark.model]

MESSAGES = ["What is the capital of France?", "Write one sentence about the sea.", "Count from one to five.",
            "Name a colour of the sky at dusk."]
MAX_NEW_TOKENS = 24

VLLM_SIDE = textwrap.dedent("""
    import json, sys
    from inference.engine.request import SamplingParams
    from inference.engine.settings import EngineSettings
    from inference.vllm_engine.engine import VllmEngine

    prompts, max_new = json.loads(sys.argv[1]), int(sys.argv[2])
    settings = EngineSettings(device="cpu", dtype="float32", max_batch=4, kv_cache_tokens=4096, max_seq_len=512)
    engine = VllmEngine(settings.default_model_dir(), settings)
    reqs = [engine.add_request_group(1, p, SamplingParams(max_new_tokens=max_new))[1][0] for p in prompts]
    while engine.has_work():
        engine.step()
    print("TOKENS " + json.dumps([r.output_token_ids for r in reqs]))
""")


def vllm_python() -> str:
    env = vllm_env()
    assert env.ready, f"the vLLM environment is not made ({env.root}): run `make setup-vllm`"
    return str(env.python)


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    from formats.chat_tokens import encode_chat
    from inference.engine.settings import EngineSettings

    tokenizer = AutoTokenizer.from_pretrained(EngineSettings().default_model_dir(), local_files_only=True)
    return [encode_chat(tokenizer, [{"role": "user", "content": m}]) for m in MESSAGES]


def test_greedy_tokens_of_the_vllm_engine_equal_ours(prompts):
    from inference.engine.engine import Engine
    from inference.engine.model_store import load_model
    from inference.engine.request import SamplingParams
    from inference.engine.settings import EngineSettings

    settings = EngineSettings(device="cpu", dtype="float32", max_batch=4, kv_cache_tokens=4096, max_seq_len=512)
    model, _ = load_model(settings)
    ours = Engine(model, settings).generate(prompts, SamplingParams(max_new_tokens=MAX_NEW_TOKENS))
    env = process_env(vllm_env(), dict(os.environ), num_threads=1)
    done = subprocess.run([vllm_python(), "-c", VLLM_SIDE, json.dumps(prompts), str(MAX_NEW_TOKENS)],
                          capture_output=True, text=True, env=env, timeout=600)
    line = next((x for x in done.stdout.splitlines() if x.startswith("TOKENS ")), None)
    assert done.returncode == 0 and line is not None, done.stderr[-4000:]
    theirs = json.loads(line.removeprefix("TOKENS "))
    assert all(len(t) > 4 for t in ours), ours  # real answers, not an immediate end
    assert theirs == ours
