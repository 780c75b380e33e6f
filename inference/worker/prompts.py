"""An ``InferenceRequest`` to what the engine takes: prompt token ids and sampling parameters.

The chat template comes from the tokenizer (``apply_chat_template`` over the request's messages,
as ``inference.engine.text.encode_prompt`` does for one message). Every check that can reject a
request happens here, before the engine sees it, and raises a named ``BadRequestError`` whose
message is the dead-letter reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from inference.engine.request import Priority as EnginePriority
from inference.engine.request import SamplingParams as EngineSampling
from inference.worker.errors import InvalidRequestError, InvalidSamplingError, PromptTooLongError
from schemas.records import InferenceRequest, Priority

ROLES = frozenset({"system", "user", "assistant"})
MAX_STOP_STRINGS = 16

ENGINE_PRIORITY = {Priority.INTERACTIVE: EnginePriority.INTERACTIVE, Priority.BATCH: EnginePriority.BATCH}


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    prompt_ids: list[int]
    params: EngineSampling
    stop: tuple[str, ...]
    priority: EnginePriority


def sampling_params(req: InferenceRequest) -> EngineSampling:
    s = req.sampling
    if s.max_tokens < 1:
        raise InvalidSamplingError(f"max_tokens must be >= 1, got {s.max_tokens}")
    for name in ("temperature", "top_p"):
        value = getattr(s, name)
        if not math.isfinite(value):
            raise InvalidSamplingError(f"{name} must be a finite number, got {value}")
    if len(s.stop) > MAX_STOP_STRINGS:
        raise InvalidSamplingError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(s.stop)}")
    try:
        return EngineSampling(max_new_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                              top_k=s.top_k, seed=s.seed)
    except ValueError as exc:  # the engine's own range checks
        raise InvalidSamplingError(str(exc)) from None


def prompt_ids(req: InferenceRequest, tokenizer: Any) -> list[int]:
    if not req.messages:
        raise InvalidRequestError("the request has no messages")
    bad = sorted({m.role for m in req.messages} - ROLES)
    if bad:
        raise InvalidRequestError(f"unknown message role(s) {bad}; expected one of {sorted(ROLES)}")
    messages = [{"role": m.role, "content": m.content} for m in req.messages]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = list(tokenizer.encode(text, add_special_tokens=False))
    else:
        ids = list(tokenizer.encode("\n".join(m["content"] for m in messages)))
    if not ids:
        raise InvalidRequestError("the prompt has no tokens")
    return ids


def prepare(req: InferenceRequest, tokenizer: Any, max_seq_len: int) -> PreparedRequest:
    """Raises ``InvalidRequestError``, ``InvalidSamplingError`` or ``PromptTooLongError``."""
    params = sampling_params(req)
    ids = prompt_ids(req, tokenizer)
    if len(ids) + params.max_new_tokens > max_seq_len:
        raise PromptTooLongError(
            f"prompt of {len(ids)} tokens + max_tokens {params.max_new_tokens} = "
            f"{len(ids) + params.max_new_tokens} tokens exceeds the model's context of {max_seq_len} tokens")
    return PreparedRequest(ids, params, tuple(s for s in req.sampling.stop if s), ENGINE_PRIORITY[req.priority])
