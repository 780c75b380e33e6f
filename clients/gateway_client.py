"""HTTP client of the chatpipe gateway: streamed chat completions, models, feedback (httpx, sync).

Speaks the gateway's OpenAI-compatible API plus its two chatpipe extensions (docs/clients.md):
the ``X-Chatpipe-Conversation-Id`` header, with which only the new user message is sent, and
``POST /v1/feedback``. Every failure (gateway down, 401, 429, context too long, a broken
stream) comes out as one :class:`GatewayError` whose message is a single line for the user.

Not here: the conversation loop and its commands (``clients.chat_session``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Literal

import httpx

from clients.sse import StreamError, StreamedAnswer, chunks
from schemas.errors import ChatpipeError

CONVERSATION_HEADER = "X-Chatpipe-Conversation-Id"
REQUEST_HEADER = "X-Chatpipe-Request-Id"
FeedbackKindName = Literal["thumbs_up", "thumbs_down", "regenerate", "edit"]  # the gateway answers any other 400


class GatewayError(ChatpipeError):
    """The gateway could not be reached or answered with an error (OpenAI error shape)."""

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass
class Turn:
    """One streamed answer and how it went, as the client saw it."""

    answer: StreamedAnswer
    conversation_id: str | None
    request_id: str | None
    ttft_s: float | None  # request sent -> first text; None if no text came
    total_s: float

    @property
    def tokens_per_s(self) -> float | None:
        """Generation speed after the first token (the decode rate a user sees)."""
        n = self.answer.completion_tokens
        if self.ttft_s is None or n < 2 or self.total_s <= self.ttft_s:
            return None
        return (n - 1) / (self.total_s - self.ttft_s)


def _error_from(response: httpx.Response) -> GatewayError:
    """A GatewayError from an error response (body already read), in OpenAI's shape or not."""
    code = message = None
    try:
        body = response.json()
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict):
            message, code = err.get("message"), err.get("code") or err.get("type")
        elif isinstance(body, dict) and "detail" in body:
            message = str(body["detail"])
    except ValueError:
        pass
    if not message:
        message = response.text.strip()[:200] or response.reason_phrase
    text = f"{response.status_code}{f' {code}' if code else ''}: {' '.join(str(message).split())}"
    retry_after = response.headers.get("retry-after")
    if retry_after:
        text += f" (retry after {retry_after} s)"
    return GatewayError(text, status=response.status_code, code=code)


class GatewayClient:
    def __init__(self, base_url: str, api_key: str | None, *, timeout_s: float = 300.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        # connect fails fast (a stopped gateway is reported at once); read waits for slow CPU answers
        self._http = httpx.Client(base_url=self.base_url, transport=transport,
                                  headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
                                  timeout=httpx.Timeout(timeout_s, connect=5.0))

    def _call(self, method: str, path: str, **kw) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise self._transport_error(exc) from exc
        if response.status_code >= 400:
            raise _error_from(response)
        return response

    def _transport_error(self, exc: httpx.HTTPError) -> GatewayError:
        if isinstance(exc, httpx.ConnectError):
            return GatewayError(f"cannot reach the gateway at {self.base_url} (is the stack up? `chatpipe status`)")
        if isinstance(exc, httpx.TimeoutException):
            return GatewayError(f"the gateway at {self.base_url} did not answer in time ({type(exc).__name__})")
        return GatewayError(f"connection to the gateway at {self.base_url} failed: {type(exc).__name__}: {exc}")

    def wait_healthy(self, timeout_s: float) -> None:
        """Wait until ``/healthz`` answers 200 (the gateway's reply consumer is assigned)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                last = self._http.get("/healthz", timeout=5.0)
                if last.status_code == 200:
                    return
                why = f"/healthz answers {last.status_code}"
            except httpx.HTTPError as exc:
                why = str(self._transport_error(exc))
            if time.monotonic() >= deadline:
                raise GatewayError(f"the gateway is not ready after {timeout_s:g} s: {why}")
            time.sleep(0.5)

    def models(self) -> list[str]:
        """Ids of the models the gateway serves (also proves the key works)."""
        data = self._call("GET", "/v1/models").json()
        return [m["id"] for m in data.get("data", [])]

    def stream_chat(self, messages: list[dict[str, str]], *, model: str, conversation_id: str | None = None,
                    max_tokens: int = 256, temperature: float = 0.7,
                    on_text: Callable[[str], None] = lambda _: None, **extra: Any) -> Turn:
        """Stream one completion, handing each piece of text to ``on_text`` as it arrives.

        With ``conversation_id`` the gateway continues that conversation (send only the new
        message); without it a new one starts and its id comes back in the returned Turn. An
        interrupt (Ctrl-C) closes the connection, which makes the gateway cancel the generation.
        """
        body = {"model": model, "messages": messages, "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": max_tokens, "temperature": temperature, **extra}
        headers = {CONVERSATION_HEADER: conversation_id} if conversation_id else {}
        answer, ttft = StreamedAnswer(), None
        start = time.perf_counter()
        try:
            with self._http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
                if response.status_code >= 400:
                    response.read()
                    raise _error_from(response)
                conversation_id = response.headers.get(CONVERSATION_HEADER, conversation_id)
                request_id = response.headers.get(REQUEST_HEADER)
                for chunk in chunks(response.iter_lines()):
                    piece = answer.add(chunk)
                    if piece:
                        if ttft is None:
                            ttft = time.perf_counter() - start
                        on_text(piece)
        except httpx.HTTPError as exc:
            raise self._transport_error(exc) from exc
        except StreamError as exc:
            raise GatewayError(f"{exc.code + ': ' if exc.code else ''}{exc}", code=exc.code) from exc
        if request_id is None and answer.completion_id and answer.completion_id.startswith("chatcmpl-"):
            request_id = answer.completion_id.removeprefix("chatcmpl-")
        return Turn(answer, conversation_id, request_id, ttft, time.perf_counter() - start)

    def send_feedback(self, *, request_id: str, conversation_id: str, kind: FeedbackKindName,
                      edited_text: str | None = None, comment: str | None = None) -> str:
        """Post feedback on one answer (it lands on ``chat.feedback``); returns its event id."""
        body = {"request_id": request_id, "conversation_id": conversation_id, "kind": kind,
                "edited_text": edited_text, "comment": comment}
        return self._call("POST", "/v1/feedback", json=body).json().get("event_id", "")

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "GatewayClient":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
