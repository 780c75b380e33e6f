"""The file store of the Files and Batch APIs (transport/file_store.py) on fsspec's in-memory filesystem
(a real fsspec filesystem with an object store's semantics: no folders of its own, no renames used) and
on a local folder: per-tenant files, the description written last, expiry, deletion."""

from __future__ import annotations

import uuid

import pytest

from transport.file_store import FileStore, FileStoreError, tenant_folder


@pytest.fixture(params=["memory", "folder"])
def store(request, tmp_path):
    uri = f"memory://files-{uuid.uuid4().hex[:8]}" if request.param == "memory" else str(tmp_path / "files")
    return FileStore(uri)


def test_a_file_is_its_tenants_alone(store):
    put = store.put("acme", "in.jsonl", "batch", iter([b'{"a": 1}\n', b'{"a": 2}\n']))
    assert (put.bytes, put.filename, put.purpose, put.expires_at) == (18, "in.jsonl", "batch", None)
    assert store.get("acme", put.id) == put and store.read("acme", put.id) == b'{"a": 1}\n{"a": 2}\n'
    assert store.get("globex", put.id) is None and store.list("globex") == []
    with pytest.raises(FileStoreError):
        store.read("globex", put.id)
    assert not store.delete("globex", put.id) and store.get("acme", put.id) == put
    assert store.delete("acme", put.id) and store.get("acme", put.id) is None and not store.delete("acme", put.id)


def test_list_is_newest_first_by_purpose_and_skips_expired(store, monkeypatch):
    first = store.put("acme", "a", "batch", iter([b"1"]))
    output = store.put("acme", "b", "batch_output", iter([b"2"]))
    short = store.put("acme", "c", "batch", iter([b"3"]), expires_after_s=60)
    listed = store.list("acme", "batch")
    assert {f.id for f in listed} == {first.id, short.id}
    assert listed == sorted(listed, key=lambda f: (f.created_at, f.id), reverse=True)
    assert [f.id for f in store.list("acme", "batch_output")] == [output.id]
    import transport.file_store as fs

    later = fs.time.time() + 61
    monkeypatch.setattr(fs.time, "time", lambda: later)
    assert store.get("acme", short.id) is None and short.id not in [f.id for f in store.list("acme")]


def test_ids_and_purposes_are_checked(store):
    with pytest.raises(FileStoreError, match="purpose must be one of batch, batch_output"):
        store.put("acme", "x", "fine-tune", iter([b"1"]))
    assert store.get("acme", "../../etc/passwd") is None and not store.delete("acme", "file-../x")


def test_tenant_folders_never_collide():
    assert tenant_folder("a/b") != tenant_folder("a_b") and "/" not in tenant_folder("a/b")
