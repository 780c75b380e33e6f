"""The file store of OpenAI's Files API: a tenant's uploaded files (batch input) and the files the
pipeline writes for it (batch output and errors), in a folder or any fsspec URI.

Layout, per tenant (``tenant_folder``: the tenant's name made safe for a path, with a hash so two
names never share a folder)::

    <root>/<tenant folder>/<file id>        the bytes
    <root>/<tenant folder>/<file id>.json   what the API says of it (``StoredFile``), written last

A file exists once its ``.json`` does: the bytes are written first, so a reader never finds the
description of a file whose bytes are missing (a store without atomic renames, an object store,
gets the same guarantee from the order). Every read names the tenant: a file id of another tenant
is simply not there (the API's 404), whatever the id. Every gateway replica, and whatever runs a
batch, sees the same files when they are given the same root (a shared volume or an object store).

Blocking (fsspec is synchronous): the gateway calls it in a thread.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterator

from schemas.errors import ChatpipeError

#: What a file is for (OpenAI's ``purpose``): uploaded batch input, and the output / error files of a batch.
PURPOSES = ("batch", "batch_output")
_ID = re.compile(r"file-[A-Za-z0-9]{8,64}")


class FileStoreError(ChatpipeError):
    """A file the store cannot take or give (the store itself being away is its own OSError)."""


@dataclass(frozen=True)
class StoredFile:
    """OpenAI's ``file`` object, as kept beside the bytes."""

    id: str
    bytes: int
    created_at: int  # seconds
    filename: str
    purpose: str
    expires_at: int | None = None  # seconds; None: kept until deleted

    def openai(self) -> dict[str, Any]:
        return {"object": "file", **asdict(self), "status": "processed", "status_details": None}


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def tenant_folder(tenant: str) -> str:
    """A folder name for ``tenant``: its safe characters, and a hash of the whole name."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", tenant)[:40]
    return f"{safe}-{hashlib.sha256(tenant.encode()).hexdigest()[:12]}"


class FileStore:
    def __init__(self, uri: str) -> None:
        import fsspec

        self.uri = uri
        self.fs, root = fsspec.core.url_to_fs(uri)
        self.root = root.rstrip("/")

    def _folder(self, tenant: str) -> str:
        return f"{self.root}/{tenant_folder(tenant)}"

    def put(self, tenant: str, filename: str, purpose: str, chunks: Iterator[bytes],
            expires_after_s: int | None = None, file_id: str | None = None) -> StoredFile:
        """Store the bytes ``chunks`` yields as a new file of ``tenant``; returns its description."""
        if purpose not in PURPOSES:
            raise FileStoreError(f"purpose must be one of {', '.join(PURPOSES)}; got {purpose!r}")
        file_id = file_id or new_file_id()
        folder = self._folder(tenant)
        self.fs.makedirs(folder, exist_ok=True)
        size = 0
        with self.fs.open(f"{folder}/{file_id}", "wb") as out:
            for chunk in chunks:
                out.write(chunk)
                size += len(chunk)
        now = int(time.time())
        stored = StoredFile(file_id, size, now, filename, purpose,
                            now + expires_after_s if expires_after_s is not None else None)
        with self.fs.open(f"{folder}/{file_id}.json", "w") as out:
            json.dump(asdict(stored), out)
        return stored

    def get(self, tenant: str, file_id: str) -> StoredFile | None:
        """The file's description; None when ``tenant`` has no such file (or it expired)."""
        if not _ID.fullmatch(file_id):
            return None
        try:
            with self.fs.open(f"{self._folder(tenant)}/{file_id}.json", "r") as f:
                stored = StoredFile(**json.load(f))
        except FileNotFoundError:
            return None
        return None if _expired(stored) else stored

    def read(self, tenant: str, file_id: str) -> bytes:
        """The file's bytes; ``FileStoreError`` when ``tenant`` has no such file."""
        if self.get(tenant, file_id) is None:
            raise FileStoreError(f"no file {file_id}")
        with self.fs.open(f"{self._folder(tenant)}/{file_id}", "rb") as f:
            return f.read()

    def list(self, tenant: str, purpose: str | None = None) -> list[StoredFile]:
        """The tenant's files (not expired), newest first."""
        try:
            names = self.fs.ls(self._folder(tenant), detail=False)
        except FileNotFoundError:
            return []
        found = []
        for name in names:
            base = name.rsplit("/", 1)[-1]
            if base.endswith(".json"):
                stored = self.get(tenant, base[:-len(".json")])
                if stored is not None and (purpose is None or stored.purpose == purpose):
                    found.append(stored)
        return sorted(found, key=lambda s: (s.created_at, s.id), reverse=True)

    def delete(self, tenant: str, file_id: str) -> bool:
        """Remove the file (its description first: from then on it is not there); False when there was none."""
        if not _ID.fullmatch(file_id):
            return False
        folder = self._folder(tenant)
        try:
            self.fs.rm_file(f"{folder}/{file_id}.json")
        except FileNotFoundError:
            return False
        try:
            self.fs.rm_file(f"{folder}/{file_id}")
        except FileNotFoundError:
            pass
        return True


def _expired(stored: StoredFile) -> bool:
    return stored.expires_at is not None and stored.expires_at <= time.time()
