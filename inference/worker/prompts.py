"""An ``InferenceRequest`` to what the engine takes: prompt token ids and sampling parameters.

The chat template comes from the tokenizer (``apply_chat_template`` over the request's messages,
as ``inference.engine.text.encode_prompt`` does for one message); a raw prompt (v3 ``raw_prompt``,
from POST /v1/completions) is tokenized as it is, without one (``raw_prompt_ids``). Every check that can reject a
request happens here, before the engine sees it, and raises a named ``BadRequestError`` whose
message is the dead-letter reason. Roles and sampling ranges are ``schemas.requests``, the one
definition the gateway and streams check with; the message count and character limits are
intake's (streams assembles this request within the context's token budget).

The sampling fields of InferenceRequest v3 map onto the engine as they are: the penalties;
``logprobs`` true -> the engine's ``logprobs`` = ``top_logprobs`` (0 = the chosen token's only),
false -> None (none computed); ``n`` and ``response_format`` stay with the worker, which submits n
sequences and builds each one's grammar matcher (``inference/worker/constraints.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from formats.chat_tokens import ChatTemplateError, encode_chat
from inference.engine.request import Priority as EnginePriority
from inference.engine.request import SamplingParams as EngineSampling
from inference.worker.errors import InvalidRequestError, InvalidSamplingError, PromptTooLongError
from schemas.records import InferenceRequest, Priority
from schemas.requests import (RequestRuleError, check_record_sampling, check_roles, check_share_weight,
                              response_format_of)

ENGINE_PRIORITY = {Priority.INTERACTIVE: EnginePriority.INTERACTIVE, Priority.BATCH: EnginePriority.BATCH}


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    prompt_ids: list[int]
    params: EngineSampling
    stop: tuple[str, ...]
    priority: EnginePriority
    n: int = 1  # choices: n sequences of the same prompt
    response_format: dict | None = None  # OpenAI's object (json_object / json_schema); None = free text
    logprobs: bool = False  # put each token's logprob (and params.logprobs alternatives) on the chunks
    share_weight: float = 1.0  # the tenant's weight in the engine's fair share (InferenceRequest v4)
    adapter: str | None = None  # the model version's engine adapter (model_versions.py); None = the base model


def sampling_params(req: InferenceRequest) -> EngineSampling:
    s = req.sampling
    try:  # max_tokens against the context: prepare, which knows the prompt's length too
        check_record_sampling(s)
        return EngineSampling(max_new_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                              top_k=s.top_k, seed=s.seed, presence_penalty=s.presence_penalty,
                              frequency_penalty=s.frequency_penalty,
                              logprobs=s.top_logprobs if s.logprobs else None)
    except (RequestRuleError, ValueError) as exc:  # ValueError: the engine's own range checks
        raise InvalidSamplingError(str(exc)) from None


def raw_prompt_ids(text: str, tokenizer: Any) -> list[int]:
    """A raw prompt's ids (InferenceRequest v3 ``raw_prompt``, POST /v1/completions): the text as it
    is, no chat template, encoded as Hugging Face's ``tokenizer(text)`` and vLLM encode a completion
    prompt (the tokenizer's own BOS if it adds one; control-token text parsed as control tokens: a
    raw prompt has no template or system prompt of ours to break out of, and writing one's own
    template markup is how such prompts are used)."""
    if not text:
        raise InvalidRequestError("raw_prompt is empty: a completion needs the text to continue")
    return list(tokenizer.encode(text))


def prompt_ids(req: InferenceRequest, tokenizer: Any) -> list[int]:
    if req.raw_prompt is not None:
        if req.messages:
            raise InvalidRequestError("a request with raw_prompt must have no messages")
        ids = raw_prompt_ids(req.raw_prompt, tokenizer)
    elif not req.messages:
        raise InvalidRequestError("the request has no messages")
    else:
        try:
            check_roles(m.role for m in req.messages)
        except RequestRuleError as exc:
            raise InvalidRequestError(str(exc)) from None
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        # The template's markup keeps its control tokens; every content is plain text (issue 19).
        try:
            ids = encode_chat(tokenizer, messages)
        except ChatTemplateError as exc:  # e.g. two user messages in a row for a template that forbids it
            raise InvalidRequestError(str(exc)) from None
    if not ids:
        raise InvalidRequestError("the prompt has no tokens")
    return ids


def prepare(req: InferenceRequest, tokenizer: Any, max_seq_len: int) -> PreparedRequest:
    """Raises ``InvalidRequestError``, ``InvalidSamplingError`` or ``PromptTooLongError``."""
    params = sampling_params(req)
    ids = prompt_ids(req, tokenizer)
    if len(ids) + params.max_new_tokens > max_seq_len:
        room = max_seq_len - len(ids)
        change = f"ask for at most {room} max_tokens or shorten the prompt" if room >= 1 else "shorten the prompt"
        raise PromptTooLongError(
            f"prompt of {len(ids)} tokens + max_tokens {params.max_new_tokens} = "
            f"{len(ids) + params.max_new_tokens} tokens exceeds the model's context of {max_seq_len} tokens; {change}")
    s = req.sampling
    try:
        check_share_weight(req.share_weight)
    except RequestRuleError as exc:
        raise InvalidRequestError(f"InferenceRequest {req.request_id!r}: {exc}") from None
    return PreparedRequest(ids, params, tuple(x for x in s.stop if x), ENGINE_PRIORITY[req.priority], n=s.n,
                           response_format=response_format_of(s.response_format), logprobs=s.logprobs,
                           share_weight=req.share_weight)
