"""One HTTP request to this gateway's own app, in process: how a batch line becomes an ordinary request.

The line goes through everything a client's request goes through (the body limit, the key, the
request model, translation, admission, the pipeline, the answer's shape) because it *is* one, minus the
socket. ``gone`` plays the client closing its connection: once set, the route's disconnect watch
(``streaming.until_disconnect``) sends the ``Cancel`` that stops the worker, as for a client that left,
and the call returns that route's 499.

Not httpx's ``ASGITransport``: its connection cannot be made to go away before the response is
complete, so a stopped line would keep its worker generating and its slot of the backlog.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


async def post(app: ASGIApp, path: str, payload: dict[str, Any], headers: dict[str, str],
               gone: asyncio.Event) -> Answer:
    """POST ``payload`` (JSON) to ``path`` of ``app``; returns the whole answer."""
    body = json.dumps(payload).encode()
    raw_headers = [(k.lower().encode(), v.encode()) for k, v in
                   {**headers, "content-type": "application/json", "content-length": str(len(body))}.items()]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": raw_headers,
             "client": ("127.0.0.1", 0), "server": ("batch-runner", 0)}
    delivered = False
    status, answer_headers, chunks = 500, {}, []

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status, answer_headers
        if message["type"] == "http.response.start":
            status = message["status"]
            answer_headers = {k.decode().lower(): v.decode() for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return Answer(status, answer_headers, b"".join(chunks))
