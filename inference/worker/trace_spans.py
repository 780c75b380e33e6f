"""The worker's spans of one generation, under the request's "process" span (transport/spans.py).

Built once the generation has ended, from the times it was seen at (the engine runs on its own
thread; a span per engine step would cost more than the step's bookkeeping):

- ``chat <model>``: the generation, with OpenTelemetry's ``gen_ai.*`` attributes (model, input and
  output tokens, finish reason, sampling parameters; the prompt and answer text only with
  ``CHATPIPE_TRACING_CAPTURE_CONTENT=true``);
- its children ``prefill`` (admitted by the engine -> first token) and ``decode`` (first token ->
  last);
- before it, ``queue wait`` (taken from Kafka -> admitted by the engine: the worker's own queue and
  the engine's waiting list).
"""

from __future__ import annotations

import json
from typing import Any

from schemas.records import FinishReason, InferenceRequest
from transport import spans


def generation_spans(parent: spans.Span, model: str, req: InferenceRequest, final: Any, reason: FinishReason, *,
                     queued_from_ns: int, started_ns: int, first_token_ns: int, ended_ns: int, answer: str) -> None:
    if not parent.sampled or not spans.recording():
        return
    admitted_ns = started_ns + int((final.queue_s or 0.0) * 1e9)
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "chat", "gen_ai.provider.name": "chatpipe", "gen_ai.request.model": model,
        "gen_ai.response.model": model, "gen_ai.usage.input_tokens": final.num_prompt_tokens,
        "gen_ai.usage.output_tokens": final.num_output_tokens,
        "gen_ai.response.finish_reasons": [reason.value.lower()],
        "gen_ai.request.max_tokens": req.sampling.max_tokens, "gen_ai.request.temperature": req.sampling.temperature,
        "gen_ai.request.top_p": req.sampling.top_p, "chatpipe.request_id": req.request_id,
    }
    if first_token_ns:
        attributes["gen_ai.server.time_to_first_token"] = (first_token_ns - queued_from_ns) / 1e9
    if spans.capture_content():
        attributes["gen_ai.input.messages"] = json.dumps([{"role": m.role, "content": m.content}
                                                          for m in req.messages])
        attributes["gen_ai.output.messages"] = json.dumps([{"role": "assistant", "content": answer}])
    parent.child("queue wait", start_ns=queued_from_ns).end(max(queued_from_ns, admitted_ns))
    chat = parent.child(f"chat {model}", attributes=attributes, start_ns=started_ns)
    if first_token_ns:
        chat.child("prefill", start_ns=admitted_ns).end(first_token_ns)
        chat.child("decode", start_ns=first_token_ns,
                   attributes={"gen_ai.usage.output_tokens": final.num_output_tokens}).end(ended_ns)
    chat.end(ended_ns)
