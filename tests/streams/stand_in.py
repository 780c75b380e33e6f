"""A stand-in inference worker for the streams tests: prompts in, a deterministic ``Response`` for
each ``InferenceRequest`` streams makes of them (no model), and a conversation driven through both.
"""

from __future__ import annotations

from schemas.records import ChatMessage, FinishReason, InferenceRequest, PromptRequest, Response, SamplingParams
from schemas.topics import PROMPTS, REPLIES, RESPONSES


def answer(request: InferenceRequest, text: str, finish: FinishReason = FinishReason.STOP) -> Response:
    """The Response a worker would send for ``request`` (deterministic, no model)."""
    return Response(request_id=request.request_id, conversation_id=request.conversation_id,
                    user_id=request.user_id, tenant=request.tenant, text=text, model=request.model,
                    worker_id="test-worker", tokens_in=request.context_tokens, tokens_out=len(text.split()),
                    queue_ms=1.5, ttft_ms=12.0, total_ms=40.0, finish_reason=finish,
                    created_at=request.created_at)


def prompt(tenant: str, user: str, conversation: str, text: str, *, reply_to: str, reply_partition: int | None = 1,
           **kw) -> PromptRequest:
    """A prompt answered at ``reply_partition`` of ``reply_to`` (a topic that exists: intake checks)."""
    return PromptRequest(conversation_id=conversation, user_id=user, tenant=tenant, model="smollm2",
                         messages=[ChatMessage("user", text)], sampling=SamplingParams(max_tokens=64),
                         reply_to=reply_to, reply_partition=reply_partition, **kw)


class Conversation:
    """Drives one conversation through the worker, playing the inference worker."""

    def __init__(self, producer, requests_tap, turns_tap, tenant, user, conversation):
        self.producer, self.requests, self.turns = producer, requests_tap, turns_tap
        self.tenant, self.user, self.conversation = tenant, user, conversation

    def ask(self, text: str, **kw) -> InferenceRequest:
        request = prompt(self.tenant, self.user, self.conversation, text,
                         reply_to=self.producer.settings.topic(REPLIES), **kw)
        self.producer.send(self.producer.settings.topic(PROMPTS), request, key=self.conversation)
        self.producer.flush()
        (got,) = self.requests.records(1, where=lambda r: r.request_id == request.request_id)
        return got

    def reply(self, request: InferenceRequest, text: str, times: int = 1):
        for _ in range(times):
            self.producer.send(self.producer.settings.topic(RESPONSES), answer(request, text),
                               key=self.conversation)
        self.producer.flush()
        (turn,) = self.turns.records(1, where=lambda t: t.request_id == request.request_id)
        return turn

    def turn(self, text: str, answer_text: str):
        request = self.ask(text)
        return request, self.reply(request, answer_text)
