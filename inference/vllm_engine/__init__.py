"""vLLM's engine behind the worker (``chatpipe inference --engine vllm``); see docs/worker.md, "Engines".

    engine.py       VllmEngine: vLLM's v1 ``LLMEngine``, in process, behind the surface of
                    ``inference.engine.Engine`` that ``AsyncEngine`` and the worker drive
    constraints.py  response_format / tool calls -> vLLM's structured outputs (the same grammar ours builds)

Runs only in the vLLM environment (``infra/vllm_env.py``: vLLM pins its own torch, so it cannot share
the project's .venv); imported by nothing but the worker's CLI, and only when that engine is chosen.
Depends on vLLM and the public types of ``inference.engine`` (requests, events, stats, errors).
"""
