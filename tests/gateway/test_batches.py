"""OpenAI's Batch API through the real pipeline (streams, inference worker with the default model, gateway),
driven by the official ``openai`` client: files in, a batch per tenant run to ``completed`` with exactly one
output line per ``custom_id``, usage on every line, the batch and its files invisible to the other tenant;
a bad line fails the batch naming its line; a cancelled batch keeps what ran and says what did not; a
batch past its window expires the same way (a second gateway with a short window, in the same runners'
group)."""

from __future__ import annotations

import json
import time

import openai
import pytest
from typer.testing import CliRunner

from chatpipe.cli import app
from chatpipe.testing.gateway import API_KEY, OTHER_TENANT_KEY, start_gateway

pytestmark = [pytest.mark.integration, pytest.mark.model]
MODEL = "smollm2-135m-instruct"


def client(url: str, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def chat_lines(prefix: str, n: int, max_tokens: int = 4) -> bytes:
    return b"".join(json.dumps({"custom_id": f"{prefix}-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
                                         "messages": [{"role": "user", "content": f"Say the number {i}."}]}}
                               ).encode() + b"\n" for i in range(n))


def wait_done(c: openai.OpenAI, batch_id: str, timeout_s: float = 600):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = c.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.5)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout_s} s: {batch.request_counts}")


def lines_of(c: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in c.files.content(file_id).read().splitlines() if line.strip()]


def start(c: openai.OpenAI, data: bytes, endpoint: str = "/v1/chat/completions", **extra):
    upload = c.files.create(file=("in.jsonl", data), purpose="batch")
    return c.batches.create(input_file_id=upload.id, endpoint=endpoint, completion_window="24h", **extra)


def test_200_lines_of_two_tenants_complete_with_one_line_per_custom_id_and_stay_their_own(pipeline):
    acme, globex = client(pipeline.url), client(pipeline.url, OTHER_TENANT_KEY)
    mine = start(acme, chat_lines("a", 100), metadata={"job": "nightly"})
    theirs = start(globex, chat_lines("g", 100))
    assert mine.status == "in_progress" and mine.request_counts.total == 100 and mine.metadata == {"job": "nightly"}
    with pytest.raises(openai.NotFoundError):
        globex.batches.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        globex.batches.cancel(mine.id)
    assert mine.id not in [b.id for b in globex.batches.list()]

    for c, batch, prefix, n in ((acme, mine, "a", 100), (globex, theirs, "g", 100)):
        done = wait_done(c, batch.id)
        assert done.status == "completed", done
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (n, n, 0)
        assert done.error_file_id is None and done.completed_at >= done.in_progress_at
        out = lines_of(c, done.output_file_id)
        assert sorted(line["custom_id"] for line in out) == sorted(f"{prefix}-{i}" for i in range(n))
        for line in out:
            body = line["response"]["body"]
            assert line["response"]["status_code"] == 200 and line["error"] is None and line["id"].startswith(
                "batch_req_")
            assert body["object"] == "chat.completion" and body["service_tier"] == "flex"
            assert 0 < body["usage"]["completion_tokens"] <= 4 and body["usage"]["prompt_tokens"] > 5
        assert done.usage.output_tokens == sum(line["response"]["body"]["usage"]["completion_tokens"] for line in out)
        output = c.files.retrieve(done.output_file_id)
        assert output.purpose == "batch_output"
    with pytest.raises(openai.NotFoundError):
        globex.files.content(wait_done(acme, mine.id).output_file_id)

    # the operator's view, from chat.batches (every tenant's)
    env = {"CHATPIPE_BOOTSTRAP_SERVERS": pipeline.kafka.bootstrap_servers, "CHATPIPE_TOPIC_PREFIX":
           pipeline.kafka.topic_prefix}
    listed = CliRunner().invoke(app, ["batch", "list", "--json"], env=env)
    assert listed.exit_code == 0, listed.output
    rows = {row["id"]: row for row in map(json.loads, listed.output.splitlines())}
    assert (rows[mine.id]["tenant"], rows[mine.id]["status"]) == ("acme", "completed")
    assert rows[theirs.id]["tenant"] == "globex" and rows[theirs.id]["request_counts"]["completed"] == 100
    shown = CliRunner().invoke(app, ["batch", "show", theirs.id, "--watch"], env=env)
    assert shown.exit_code == 0 and json.loads(shown.output)["output_file_id"], shown.output
    missing = CliRunner().invoke(app, ["batch", "show", "batch_nope"], env=env)
    assert missing.exit_code == 1 and "no batch batch_nope" in missing.output


def test_a_line_goes_through_memory_only_when_it_names_a_conversation(pipeline):
    """A batch line is remembered (and recalls) only when its body names a conversation
    (``metadata.conversation_id``); the rest are sent with memory off (PromptRequest v8 ``memory``)."""
    from chatpipe.testing.streams import Tap
    from schemas.codec import default_codec

    acme = client(pipeline.url)
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "Hello."}]}
    named = {**body, "metadata": {"conversation_id": f"batch-conv-{time.time_ns()}"}}
    data = b"".join(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": b}).encode()
                    + b"\n" for cid, b in (("off", body), ("on", named)))
    done = wait_done(acme, start(acme, data).id)
    request_ids = {line["custom_id"]: line["response"]["request_id"] for line in lines_of(acme, done.output_file_id)}
    tap, codec = Tap(pipeline.kafka, "chat.turns"), default_codec()
    try:
        turns = {m.key().decode(): codec.decode(m.value()) for m in tap.messages(
            2, timeout_s=60, where=lambda m: codec.decode(m.value()).request_id in request_ids.values())}
    finally:
        tap.close()
    remembered = {t.request_id: t.remembered for t in turns.values()}
    assert remembered == {request_ids["off"]: False, request_ids["on"]: True}, remembered


def test_a_bad_line_fails_the_batch_naming_the_line(pipeline):
    acme = client(pipeline.url)
    good = chat_lines("v", 2).decode().splitlines()
    bad = json.loads(good[1])
    bad["url"] = "/v1/embeddings"
    data = "\n".join([good[0], json.dumps(bad), good[0]]).encode()
    batch = start(acme, data)
    assert batch.status == "failed" and batch.failed_at is not None
    errors = [(e.code, e.line) for e in batch.errors.data]
    assert errors == [("mismatched_url", 2), ("duplicate_custom_id", 3)], batch.errors
    assert acme.batches.retrieve(batch.id).status == "failed"


def test_a_cancelled_batch_keeps_what_ran_and_names_what_did_not(pipeline):
    acme = client(pipeline.url)
    batch = start(acme, chat_lines("c", 40, max_tokens=48))
    deadline = time.monotonic() + 120
    while acme.batches.retrieve(batch.id).request_counts.completed < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    cancelling = acme.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_done(acme, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    out, errors = lines_of(acme, done.output_file_id), lines_of(acme, done.error_file_id)
    assert 2 <= len(out) < 40 and done.request_counts.completed == len(out)
    assert sorted(line["custom_id"] for line in out + errors) == sorted(f"c-{i}" for i in range(40))
    assert {line["error"]["code"] for line in errors} == {"batch_cancelled"}
    with pytest.raises(openai.ConflictError):
        acme.batches.cancel(batch.id)


def test_a_batch_past_its_window_expires_keeping_the_lines_done(pipeline, tmp_path):
    short = start_gateway(pipeline.kafka, tmp_path, CHATPIPE_GATEWAY_BATCH_WINDOW_S="6",
                          CHATPIPE_GATEWAY_FILES_URI=str(pipeline.root / "files"))  # the files every replica shares
    try:
        short.wait_healthy(90)
        batch = start(client(short.url), chat_lines("x", 60, max_tokens=64))
        env = {"CHATPIPE_BOOTSTRAP_SERVERS": pipeline.kafka.bootstrap_servers,
               "CHATPIPE_TOPIC_PREFIX": pipeline.kafka.topic_prefix}
        watched = CliRunner().invoke(app, ["batch", "show", batch.id, "--watch"], env=env)  # follows it to its end
        assert watched.exit_code == 0 and json.loads(watched.output[watched.output.index("{"):])["status"] == "expired"
        done = wait_done(client(pipeline.url), batch.id)  # run by whichever gateway owns its partition
        assert done.status == "expired" and done.expired_at >= done.expires_at
        acme = client(pipeline.url)
        out, errors = lines_of(acme, done.output_file_id), lines_of(acme, done.error_file_id)
        assert sorted(line["custom_id"] for line in out + errors) == sorted(f"x-{i}" for i in range(60))
        assert errors and {line["error"]["code"] for line in errors} == {"batch_expired"}
    finally:
        assert short.terminate() == 0, short.log()[-3000:]
