"""API keys -> tenants, from a JSON keys file.

    {"sk-...": {"tenant": "acme", "user": "ada"}, "sk-other": "globex"}

A plain string value is the tenant. ``user`` is optional: without it, requests of that key that
name no ``user`` belong to ``key-<hash of the key>`` (memory is per tenant and user, so two keys
of one tenant never read each other's turns by default). Keys are compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from pathlib import Path

from schemas.errors import ChatpipeError


class KeysFileError(ChatpipeError):
    """The keys file is missing or not in the documented shape."""


@dataclass(frozen=True, slots=True)
class Principal:
    tenant: str
    user_id: str  # default user of the key


class KeyStore:
    def __init__(self, entries: dict[str, Principal]) -> None:
        self._entries = entries

    @classmethod
    def load(cls, path: Path | None) -> "KeyStore":
        if path is None:
            raise KeysFileError("the gateway needs a keys file (--keys-file or CHATPIPE_GATEWAY_KEYS_FILE): "
                                'JSON like {"sk-...": {"tenant": "acme"}}; `chatpipe up` writes one')
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise KeysFileError(f"keys file {path} does not exist") from None
        except (OSError, ValueError) as exc:
            raise KeysFileError(f"keys file {path}: {exc}") from None
        if not isinstance(raw, dict) or not raw:
            raise KeysFileError(f'keys file {path}: expected a non-empty JSON object {{"<key>": {{"tenant": ...}}}}')
        entries = {}
        for key, value in raw.items():
            if isinstance(value, str):
                value = {"tenant": value}
            if not isinstance(value, dict) or not str(value.get("tenant", "")).strip():
                raise KeysFileError(f"keys file {path}: key {key[:6]}...: needs a tenant")
            user = str(value.get("user") or f"key-{hashlib.sha256(key.encode()).hexdigest()[:12]}")
            entries[key] = Principal(str(value["tenant"]), user)
        return cls(entries)

    def lookup(self, authorization: str | None) -> Principal | None:
        """The principal of an ``Authorization: Bearer <key>`` header, None when missing or unknown."""
        if not authorization or not authorization.lower().startswith("bearer "):
            return None
        given = authorization[7:].strip().encode()
        found = None
        for key, principal in self._entries.items():  # no early exit: time does not tell which prefix matched
            if hmac.compare_digest(key.encode(), given):
                found = principal
        return found
