"""OpenAI's Files API on the real ``chatpipe gateway`` (two replicas sharing one file store, on the session
broker), driven by the official ``openai`` client: upload, list, retrieve, content, delete; one tenant
never sees another's files (404, as for an id that never existed); bad uploads get 400/413 saying what
is wrong (the line number of a line that is not JSON). No pipeline behind: files never reach Kafka."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from chatpipe.testing.gateway import API_KEY, OTHER_TENANT_KEY, start_gateway

pytestmark = pytest.mark.integration
MAX_FILE_BYTES, MAX_FILE_LINES = 4096, 5


def jsonl(*requests: dict) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in requests)


def request_line(i: int) -> dict:
    return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": f"hi {i}"}]}}


@pytest.fixture(scope="module")
def replicas(kafka_settings, catalog_topics, tmp_path_factory):
    root = tmp_path_factory.mktemp("files")
    env = {"CHATPIPE_GATEWAY_FILES_URI": str(root / "store"), "CHATPIPE_GATEWAY_MAX_FILE_BYTES": str(MAX_FILE_BYTES),
           "CHATPIPE_GATEWAY_MAX_FILE_LINES": str(MAX_FILE_LINES)}
    gateways = []
    for name in ("a", "b"):
        (root / name).mkdir()
        gateways.append(start_gateway(kafka_settings, root / name, **env))
    try:
        for g in gateways:
            g.wait_healthy(90)
        yield gateways, root / "store"
        assert [g.terminate() for g in gateways] == [0, 0], gateways[0].log()[-3000:]
    finally:
        for g in gateways:
            g.terminate()


def client(url: str, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def test_a_file_goes_up_on_one_replica_and_is_read_back_on_the_other(replicas):
    (a, b), store = replicas
    data = jsonl(*(request_line(i) for i in range(3)))
    up = client(a.url).files.create(file=("in.jsonl", data), purpose="batch")
    assert up.id.startswith("file-") and (up.bytes, up.filename, up.purpose, up.status) == (
        len(data), "in.jsonl", "batch", "processed")
    other = client(b.url)
    assert other.files.retrieve(up.id).model_dump() == up.model_dump()
    assert other.files.content(up.id).read() == data
    assert up.id in [f.id for f in other.files.list(purpose="batch")]
    assert not list(other.files.list(purpose="batch_output")) or up.id not in [
        f.id for f in other.files.list(purpose="batch_output")]
    deleted = other.files.delete(up.id)
    assert (deleted.id, deleted.deleted) == (up.id, True)
    with pytest.raises(openai.NotFoundError):
        client(a.url).files.retrieve(up.id)
    assert not [p for p in store.rglob(f"{up.id}*")], "the bytes and the description are gone from the store"
    metrics = httpx.get(f"{a.url}/metrics", timeout=30).text  # each call counted by operation and outcome
    assert 'chatpipe_gateway_file_operations_total{operation="upload",outcome="ok"}' in metrics
    assert 'chatpipe_gateway_file_operations_total{operation="retrieve",outcome="file_not_found"}' in metrics


def test_another_tenants_file_is_not_there_for_any_route(replicas):
    (a, b), _ = replicas
    mine = client(a.url).files.create(file=("mine.jsonl", jsonl(request_line(1))), purpose="batch")
    theirs = client(b.url, OTHER_TENANT_KEY)
    with pytest.raises(openai.NotFoundError) as caught:
        theirs.files.retrieve(mine.id)
    assert caught.value.body["code"] == "file_not_found"
    with pytest.raises(openai.NotFoundError):
        theirs.files.content(mine.id)
    with pytest.raises(openai.NotFoundError):
        theirs.files.delete(mine.id)
    assert mine.id not in [f.id for f in theirs.files.list()]
    assert client(a.url).files.retrieve(mine.id).id == mine.id  # still there for its own tenant


def test_the_list_pages_newest_first_with_after_and_limit(replicas):
    (a, _), _ = replicas
    c = client(a.url, OTHER_TENANT_KEY)
    ids = [c.files.create(file=(f"p{i}.jsonl", jsonl(request_line(i))), purpose="batch").id for i in range(3)]
    first = c.files.list(limit=2, order="desc")
    newest = [f.id for f in first.data]
    assert first.has_more and len(newest) == 2 and set(newest) <= set(ids)
    rest = c.files.list(limit=2, order="desc", after=newest[-1])
    assert not rest.has_more and set(newest + [f.id for f in rest.data]) >= set(ids)
    assert [f.id for f in c.files.list(order="asc")] == [f.id for f in c.files.list(order="desc")][::-1]


def test_expires_after_sets_expires_at(replicas):
    (a, _), _ = replicas
    up = client(a.url).files.create(file=("e.jsonl", jsonl(request_line(1))), purpose="batch",
                                    expires_after={"anchor": "created_at", "seconds": 3600})
    assert up.expires_at == up.created_at + 3600


@pytest.mark.parametrize("content, purpose, status, param, says", [
    (jsonl(request_line(1)) + b"{not json\n", "batch", 400, "file", "line 2 of the file is not JSON"),
    (jsonl(request_line(1)) + b"[1, 2]\n", "batch", 400, "file", "line 2 of the file is not a JSON object"),
    (b"\n\n", "batch", 400, "file", "the file holds no requests"),
    (jsonl(*(request_line(i) for i in range(MAX_FILE_LINES + 1))), "batch", 400, "file",
     f"more than {MAX_FILE_LINES} requests (line {MAX_FILE_LINES + 1})"),
    (b"x" * (MAX_FILE_BYTES + 1), "batch", 413, "file", f"at most {MAX_FILE_BYTES} bytes"),
    (b"y" * (MAX_FILE_BYTES + 100_000), "batch", 413, "file", "CHATPIPE_GATEWAY_MAX_FILE_BYTES"),
    (jsonl(request_line(1)), "fine-tune", 400, "purpose", "purpose 'fine-tune' is not taken here"),
])
def test_a_bad_upload_says_what_is_wrong_and_stores_nothing(replicas, content, purpose, status, param, says):
    (a, _), store = replicas
    before = sorted(p.name for p in store.rglob("*"))
    response = httpx.post(f"{a.url}/v1/files", headers={"Authorization": f"Bearer {API_KEY}"},
                          files={"file": ("bad.jsonl", content)}, data={"purpose": purpose}, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert sorted(p.name for p in store.rglob("*")) == before


def test_a_file_without_a_key_is_401(replicas):
    (a, _), _ = replicas
    response = httpx.get(f"{a.url}/v1/files", timeout=30)
    assert response.status_code == 401
