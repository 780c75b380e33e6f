"""``chatpipe chat`` and ``chatpipe demo`` through the real pipeline (streams + worker + gateway).

Guards: the chat client continues one conversation by id (sending only the new message) and
streams; every feedback command lands on ``chat.feedback`` pointing at the right answer; the
demo recalls turn 1's fact and finds the local stack's key file; gateway errors reach the user
as one line.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chatpipe.testing.gateway import API_KEY
from clients.chat_session import ChatSession, run_chat
from clients.gateway_client import GatewayClient
from clients.topic_tail import TopicTail

pytestmark = [pytest.mark.integration, pytest.mark.model]
CHATPIPE = str(Path(sys.executable).with_name("chatpipe"))
MODEL = "smollm2-135m-instruct"


def feedback_records(kafka, conversation_id: str, count: int, timeout_s: float = 60) -> list[dict]:
    """The Feedback lines of ``conversation_id`` on chat.feedback, read with ``chatpipe tail``'s reader."""
    deadline = time.monotonic() + timeout_s
    while True:
        with TopicTail(kafka, "chat.feedback", from_beginning=True) as tail:
            lines = [x for batch in tail.batches(idle_timeout_s=1.0) for x in batch
                     if x.get("value") and x["value"]["conversation_id"] == conversation_id]
        if len(lines) >= count or time.monotonic() > deadline:
            return sorted(lines, key=lambda x: x["value"]["created_at"])
        time.sleep(0.5)


def test_scripted_chat_keeps_the_conversation_and_lands_every_feedback_kind(pipeline):
    """Guards against: a conversation id not being carried from turn to turn, /regen not asking
    the same prompt again (or rating the wrong answer), feedback pointing at the wrong request,
    /new continuing the old conversation, and answers arriving in one piece instead of streamed."""
    pieces: list[str] = []
    asked: list[tuple[str, str | None, str | None]] = []
    with GatewayClient(pipeline.url, API_KEY) as client:
        session = ChatSession(client, model=MODEL, max_tokens=12, temperature=0, on_text=pieces.append)
        ask = session.ask

        def recording_ask(prompt: str):
            turn = ask(prompt)
            asked.append((prompt, turn.request_id, turn.conversation_id))
            return turn

        session.ask = recording_ask  # /regen goes through it too: it calls self.ask
        out, err = io.StringIO(), io.StringIO()
        lines = ["Say hello in three words.", "/up", "/edit Hello, dear friend!", "/regen", "/down",
                 "/new", "Name a colour.", "/quit", "never sent"]
        failures = run_chat(session, lines, out=out, err=err, echo=True)
    assert failures == 0, err.getvalue()
    assert [a[0] for a in asked] == ["Say hello in three words.", "Say hello in three words.", "Name a colour."]
    (_, first_req, conv), (_, regen_req, regen_conv), (_, _, new_conv) = asked
    assert regen_conv == conv and new_conv != conv and first_req != regen_req
    assert err.getvalue().count("[ttft") == 3 and "never sent" not in out.getvalue()
    assert len(pieces) > 3, "answers were not streamed in pieces"

    records = feedback_records(pipeline.kafka, conv, 4)
    got = [(x["value"]["kind"], x["value"]["request_id"], x["value"]["edited_text"]) for x in records]
    assert got == [("THUMBS_UP", first_req, None), ("EDIT", first_req, "Hello, dear friend!"),
                   ("REGENERATE", first_req, None), ("THUMBS_DOWN", regen_req, None)]
    assert {x["value"]["tenant"] for x in records} == {"acme"}  # from the key, not from the client


def test_demo_recalls_the_first_turns_fact_with_the_stacks_key_file(pipeline, tmp_path):
    """Guards against the README's demo not showing recall (the fact of turn 1 missing from the
    answer of the last turn), losing its per-turn figures, or not finding the key that
    `chatpipe up` writes to <state dir>/gateway/keys.json."""
    (tmp_path / "gateway").mkdir()
    (tmp_path / "gateway" / "keys.json").write_text(json.dumps({API_KEY: {"tenant": "acme"}}))
    done = subprocess.run([CHATPIPE, "demo", "--url", pipeline.url, "--state-dir", str(tmp_path), "--wait-s", "30"],
                          capture_output=True, text=True, timeout=600)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    last_answer = done.stdout.split("you> What is my cat called?")[1].split("turn 4 [")[0]
    assert "pixel" in last_answer.lower()
    for i in range(1, 5):
        assert f"turn {i} [ttft " in done.stdout
    assert "recall: turn 4" in done.stdout
    assert ".venv/bin/chatpipe chat" in done.stdout and ".venv/bin/chatpipe down" in done.stdout


def test_gateway_errors_reach_the_user_as_one_line(pipeline):
    """Guards against a bad key or an over-long prompt ending in a traceback or a page of text,
    and a script not learning from the exit code that a line failed."""
    bad_key = subprocess.run([CHATPIPE, "chat", "--url", pipeline.url, "--api-key", "sk-wrong"], input="hi\n",
                             capture_output=True, text=True, timeout=120)
    assert bad_key.returncode == 1
    assert bad_key.stderr.strip().splitlines() == [bad_key.stderr.strip()] and "401" in bad_key.stderr

    with GatewayClient(pipeline.url, API_KEY) as client:
        session = ChatSession(client, model=MODEL, max_tokens=8, temperature=0)
        out, err = io.StringIO(), io.StringIO()
        failures = run_chat(session, ["word " * 3000], out=out, err=err, echo=False)
    assert failures == 1
    [line] = err.getvalue().splitlines()
    assert line.startswith("error: ") and "context_length_exceeded" in line


def test_an_idle_keep_alive_connection_outlives_the_clients_own_expiry(pipeline):
    """Guards against the gateway closing idle connections after 5 s, the same time httpx and the OpenAI SDK
    keep theirs: a client reusing one just as the server closes it got a reset (a ReadError in
    test_load.py after a 5 s Retry-After). One connection, a request, 6 s idle, a second request on it."""
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(pipeline.url)
    request = f"GET /healthz HTTP/1.1\r\nHost: {where.hostname}\r\n\r\n".encode()
    with socket.create_connection((where.hostname, where.port), timeout=30) as conn:
        replies = conn.makefile("rb")

        def exchange() -> bytes:
            conn.sendall(request)
            status, length = replies.readline(), 0
            while (line := replies.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            replies.read(length)
            return status

        assert exchange().startswith(b"HTTP/1.1 200")
        time.sleep(6)
        assert exchange().startswith(b"HTTP/1.1 200"), "the gateway closed an idle connection within 6 s"
