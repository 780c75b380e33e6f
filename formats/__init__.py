"""Request formats shared by the tiers: pure rules, no I/O, no model.

    chat_tokens.py      the one tokenization of a chat prompt: template control tokens, contents as
                        plain text (the engine's CLI, the inference worker, the streams context budget)
    response_format.py  structured outputs' pure half: which ``response_format`` / tool parameters
                        schemas can be enforced (the gateway's 400, the worker's compiler), and the
                        tool-call text convention (``<tool_call>...</tool_call>``)
    errors.py           ``FormatError``: a format that can never be enforced as given

Layering (``[tool.importlinter]`` in pyproject.toml): below the tiers and ``inference.engine``,
beside ``transport``, above ``schemas``; it imports ``schemas`` only (and, lazily, xgrammar to
check a schema compiles: no tokenizer, no torch of its own).
"""
