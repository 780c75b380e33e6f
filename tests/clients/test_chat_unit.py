"""``chatpipe chat``'s pieces that need no gateway: SSE parsing, answer folding, commands, the
API key lookup, and error lines. The gateway itself is exercised in tests/gateway/test_chat.py."""

from __future__ import annotations

import io
import json

import httpx
import pytest

from chatpipe.testing.ports import free_port
from clients.chat_session import ChatCommandError, ChatSession, Command, message_text, parse_command, run_chat
from clients.gateway_client import GatewayClient, GatewayError
from clients.settings import ApiKeyError, ClientSettings, find_api_key
from clients.sse import StreamedAnswer, StreamError, chunks, sse_data


def _chunk(content=None, finish=None, usage=None, cid="chatcmpl-r1") -> str:
    choices = [] if content is None and finish is None else [
        {"index": 0, "delta": {} if content is None else {"content": content}, "finish_reason": finish}]
    return "data: " + json.dumps({"id": cid, "object": "chat.completion.chunk", "choices": choices, "usage": usage})


def test_sse_events_join_data_lines_and_skip_comments_and_other_fields():
    """Guards against keep-alive comments or event/id fields leaking into the data, multi-line
    data being split into several events, and a last event without its blank line being lost."""
    lines = [": keep-alive", "event: message", "id: 7", "data: {\"a\":", "data: 1}", "", "", "data:[DONE]"]
    assert list(sse_data(lines)) == ['{"a":\n1}', "[DONE]"]


def test_chunks_stop_at_done_and_fold_into_one_answer_with_usage():
    """Guards against text after [DONE] being read, the usage-only last chunk (no choices)
    breaking the fold, and the token count ignoring the server's usage."""
    lines = [_chunk("Hel"), "", _chunk(""), "", _chunk("lo"), "", _chunk(finish="stop"), "",
             _chunk(usage={"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}), "",
             "data: [DONE]", "", _chunk("after done"), ""]
    answer, pieces = StreamedAnswer(), []
    for chunk in chunks(lines):
        piece = answer.add(chunk)
        if piece:
            pieces.append(piece)
    assert pieces == ["Hel", "lo"] and answer.text == "Hello"
    assert answer.finish_reason == "stop" and answer.completion_id == "chatcmpl-r1"
    assert answer.completion_tokens == 3 and answer.content_chunks == 2
    assert StreamedAnswer(text="x", content_chunks=4).completion_tokens == 4  # no usage: chunks counted


def test_an_error_object_or_bad_json_in_the_stream_raises_a_named_error():
    """Guards against an error sent mid-stream (OpenAI shape) being shown as an empty answer,
    and a garbled event raising a bare JSONDecodeError (a traceback for the user)."""
    err = 'data: {"error": {"message": "context too long", "type": "invalid_request_error", "code": "context_length_exceeded"}}'
    with pytest.raises(StreamError, match="context too long") as info:
        list(chunks([_chunk("a"), "", err, ""]))
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(StreamError, match="not JSON"):
        list(chunks(["data: {oops", ""]))


@pytest.mark.parametrize("line, command", [
    ("/up", Command("up")), ("  /down ", Command("down")), ("/regen", Command("regen")),
    ("/edit Paris is the capital.", Command("edit", "Paris is the capital.")), ("/new", Command("new")),
    ("/quit", Command("quit")), ("/exit", Command("quit")), ("/UP", Command("up")),
    ("hello /up", None), ("//up is a word", None), ("", None),
])
def test_commands_are_parsed_and_messages_are_left_alone(line, command):
    """Guards against a command being sent to the model as a message, or a message that merely
    contains a slash being taken for a command."""
    assert parse_command(line) == command


def test_unknown_or_incomplete_commands_are_named_errors():
    """Guards against a typo like /quti being sent to the model, and /edit with no text being
    posted as an empty edit."""
    with pytest.raises(ChatCommandError, match="unknown command /quti"):
        parse_command("/quti")
    with pytest.raises(ChatCommandError, match="/edit needs"):
        parse_command("/edit   ")
    assert message_text("//up is a word") == "/up is a word"


def test_api_key_comes_from_flag_then_env_then_the_stacks_keys_file(tmp_path, monkeypatch):
    """Guards against the keys file overriding an explicit key, the env variable being ignored,
    and a missing or broken keys file ending in a traceback instead of a message saying what to do."""
    monkeypatch.delenv("CHATPIPE_API_KEY", raising=False)
    keys = tmp_path / "gateway" / "keys.json"
    with pytest.raises(ApiKeyError, match="chatpipe up"):
        find_api_key(ClientSettings(state_dir=tmp_path))
    keys.parent.mkdir()
    keys.write_text("{not json")
    with pytest.raises(ApiKeyError, match="cannot read the keys file"):
        find_api_key(ClientSettings(state_dir=tmp_path))
    keys.write_text(json.dumps({"sk-local-first": {"tenant": "local"}, "sk-second": "other"}))
    assert find_api_key(ClientSettings(state_dir=tmp_path)) == "sk-local-first"
    monkeypatch.setenv("CHATPIPE_API_KEY", "sk-env")
    assert find_api_key(ClientSettings(state_dir=tmp_path)) == "sk-env"
    assert find_api_key(ClientSettings(state_dir=tmp_path, api_key="sk-flag")) == "sk-flag"


def test_http_errors_become_one_line_messages():
    """Uses httpx.MockTransport in place of the gateway: this is a unit test of parsing OpenAI
    error bodies (the real gateway's errors are checked in test_chat_gateway.py).
    Guards against a 429 losing its Retry-After, an error body's message being lost, and a
    multi-line message breaking the one-line rule."""
    answers = {
        "/v1/models": httpx.Response(401, json={"error": {"message": "Invalid API key.", "type": "invalid_request_error",
                                                          "param": None, "code": "invalid_api_key"}}),
        "/v1/chat/completions": httpx.Response(429, headers={"Retry-After": "2"}, json={"error": {
            "message": "backlog full\ntry later", "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}}),
        "/v1/feedback": httpx.Response(500, text="Internal Server Error"),
    }
    client = GatewayClient("http://gw", "sk", transport=httpx.MockTransport(lambda req: answers[req.url.path]))
    with pytest.raises(GatewayError) as info:
        client.models()
    assert str(info.value) == "401 invalid_api_key: Invalid API key." and info.value.status == 401
    with pytest.raises(GatewayError) as info:
        client.stream_chat([{"role": "user", "content": "hi"}], model="m")
    assert str(info.value) == "429 rate_limit_exceeded: backlog full try later (retry after 2 s)"
    with pytest.raises(GatewayError, match="^500: Internal Server Error$"):
        client.send_feedback(request_id="r", conversation_id="c", kind="thumbs_up")


def test_a_stopped_gateway_and_a_premature_command_are_error_lines_not_tracebacks():
    """Guards against connection refused escaping as an httpx traceback, /up before any answer
    posting feedback for nothing, and a failed line ending the chat (the next line still runs)."""
    client = GatewayClient(f"http://127.0.0.1:{free_port()}", "sk")
    session = ChatSession(client, model="m", max_tokens=8, temperature=0)
    out, err = io.StringIO(), io.StringIO()
    failures = run_chat(session, ["/up", "hello", "/bogus", "/quit", "never read"], out=out, err=err, echo=True)
    assert failures == 3
    errors = err.getvalue().splitlines()
    assert errors[0] == "error: no answer yet to give feedback on"
    assert errors[1].startswith("error: cannot reach the gateway at http://127.0.0.1:")
    assert errors[2].startswith("error: unknown command /bogus")
    assert "never read" not in out.getvalue() and "you> hello\nassistant> \n" in out.getvalue()


def test_clients_find_the_gateway_port_the_local_stack_was_started_with(tmp_path):
    """`chatpipe up --gateway-port 8123` saves the port in stack.json: chat and demo must go there,
    not to the default 8000, unless a URL is given."""
    import json

    from clients.settings import ClientSettings

    (tmp_path / "stack.json").write_text(json.dumps({"settings": {"host": "127.0.0.1", "gateway_port": 8123},
                                                     "services": ["kafka", "gateway"]}))
    assert ClientSettings(state_dir=tmp_path).gateway_url == "http://127.0.0.1:8123"
    assert ClientSettings(state_dir=tmp_path, gateway_url="http://other:1").gateway_url == "http://other:1"
    assert ClientSettings(state_dir=tmp_path / "none").gateway_url == "http://127.0.0.1:8000"
