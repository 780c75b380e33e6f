"""The local stack's gateway API key: ``<state_dir>/gateway/keys.json``, written once by ``chatpipe up``.

The file is the gateway's keys file (``{"<key>": {"tenant": "<tenant>", ...}}``, see docs/gateway.md);
``up`` makes it with one random ``sk-local-...`` key of tenant ``local`` when it is missing,
readable by its owner only. An existing file is never rewritten: keys added by hand stay.

The local key is **multi-user** (``"users": "any"``): an application tried against the local stack
may pass OpenAI's ``user`` (it becomes ``key-<hash>:<user>``, memory across that user's
conversations), and ``chatpipe chat`` / ``chatpipe demo``, which name nobody, keep memory within
their conversation. Not bound to one user: a bound key's requests would all share one memory
across every conversation, the mix issue 19 removed.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from schemas.errors import ChatpipeError

LOCAL_TENANT = "local"


class KeysFileError(ChatpipeError):
    """The keys file exists but holds no usable key."""


def ensure_keys_file(path: Path) -> tuple[str, bool]:
    """(the file's first key, whether it was created now)."""
    if path.exists():
        return first_key(path), False
    path.parent.mkdir(parents=True, exist_ok=True)
    key = f"sk-local-{secrets.token_urlsafe(24)}"
    # "x" (O_EXCL) + mode 0600 at creation: the key is never readable by others, not even for a moment.
    with open(path, "x", opener=lambda name, flags: os.open(name, flags, 0o600)) as out:
        out.write(json.dumps({key: {"tenant": LOCAL_TENANT, "users": "any"}}, indent=2) + "\n")  # multi-user: see above
    return key, True


def first_key(path: Path) -> str:
    try:
        keys = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise KeysFileError(f"{path}: not a JSON keys file ({exc})") from None
    if not isinstance(keys, dict) or not keys:
        raise KeysFileError(f'{path}: no key in it; expected {{"sk-...": {{"tenant": "..."}}}}')
    return next(iter(keys))
