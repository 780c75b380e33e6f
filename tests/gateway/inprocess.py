"""The gateway's FastAPI app in this process, with no Kafka: a producer that answers each
``PromptRequest`` at once by putting the test's ``TokenChunk``s on the request's reply queue, as
the reply reader would. For the HTTP shapes (request fields, choices, logprobs, SSE) in
milliseconds, with httpx or the official ``openai`` client (``http_client=app_client(...)``).

Not for: anything Kafka does (ordering across partitions, outages, the real reply reader): those
are the integration tests' (stack.py, fake_pipeline.py).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Callable

from starlette.testclient import TestClient

from gateway.replies import Reply
from schemas.records import FinishReason, PromptRequest, TokenChunk, TokenLogprob, TopLogprob

API_KEY = "sk-inprocess-test"
MODEL = "smollm2-135m-instruct"
Answer = Callable[[PromptRequest], list[TokenChunk]]


class AnsweringProducer:
    """Takes what the gateway sends; a PromptRequest is answered with ``answer(prompt)``'s chunks
    (attempt header "a1", or the chunk's own with ``attempts``), each a loop turn apart."""

    def __init__(self, service, answer: Answer, attempts: dict[int, str] | None = None) -> None:
        self.service, self.answer = service, answer
        self.sent: list[tuple[str, object]] = []
        self.attempts = attempts or {}

    def send(self, topic, record, *, want_ack=True, **_):
        self.sent.append((topic, record))
        loop = asyncio.get_running_loop()
        if isinstance(record, PromptRequest):
            queue = self.service.reader.queues[record.request_id]
            for i, chunk in enumerate(self.answer(record)):
                loop.call_soon(queue.put_nowait, Reply(chunk, self.attempts.get(i, "a1")))
        if want_ack:
            future = loop.create_future()
            future.set_result(None)
            return future
        return None

    def close(self, *_):
        pass


class QueueReader:
    def __init__(self) -> None:
        self.queues: dict[str, asyncio.Queue] = {}
        self.ready = True
        self.failure = None  # a ReplyReader's: why it stopped

    def register(self, request_id):
        self.queues[request_id] = asyncio.Queue()
        return self.queues[request_id]

    def unregister(self, request_id):
        self.queues.pop(request_id, None)

    def close(self):
        pass


def app_client(tmp_path: Path, answer: Answer, attempts: dict[int, str] | None = None, *, keys: dict | None = None,
               **settings) -> TestClient:
    """A TestClient of the gateway's app (lifespan not run: no Kafka); ``.producer`` is its producer.
    ``keys``: more entries of the keys file (the client sends ``API_KEY``, a multi-user key of acme)."""
    from gateway.app import create_app
    from gateway.keys import KeyStore
    from gateway.settings import GatewaySettings
    from transport.settings import KafkaSettings

    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps({API_KEY: {"tenant": "acme", "users": "any"}, **(keys or {})}))
    app = create_app(KafkaSettings(), GatewaySettings(keys_file=keys_file, **settings), KeyStore.load(keys_file))
    service = app.state.service
    service.reply_topic, service.reader = "chat.replies.gw", QueueReader()
    service.producer = AnsweringProducer(service, answer, attempts)
    client = TestClient(app, base_url="http://testserver", headers={"Authorization": f"Bearer {API_KEY}"})
    client.producer = service.producer
    return client


def token(text: str, logprob: float, top: list[tuple[str, float]] = ()) -> TokenLogprob:
    return TokenLogprob(text, logprob, text.encode(), [TopLogprob(t, lp, t.encode()) for t, lp in top])


def piece(prompt: PromptRequest, choice: int, index: int, text: str, *, logprobs: list[TokenLogprob] | None = None,
          final: bool = False, finish: FinishReason = FinishReason.STOP, tokens_out: int | None = None,
          error_code: str | None = None, error: str | None = None) -> TokenChunk:
    """One chunk of choice ``choice`` (its ``index``-th); a final one says how the choice ended."""
    return TokenChunk(request_id=prompt.request_id, conversation_id=prompt.conversation_id, index=index, text=text,
                      token_ids=list(range(len(logprobs or []))), is_final=final, worker_id="w",
                      choice_index=choice, logprobs=logprobs,
                      finish_reason=finish if final else None, tokens_in=7 if final else None,
                      tokens_out=tokens_out if final else None, error_code=error_code, error=error)
