"""API keys -> tenants and the end users each key may name, from a JSON keys file.

    {"sk-app":   {"tenant": "acme", "user": "ada"},                      # bound: always user "ada"
     "sk-multi": {"tenant": "acme", "users": "any", "namespace": "shop"}, # multi-user: "user": "bob" -> "shop:bob"
     "sk-plain": {"tenant": "acme"},                                       # plain: names nobody
     "sk-other": "globex",                                                 # a plain string: the tenant, a plain key
     "sk-big":   {"tenant": "initech", "weight": 3},                       # 3x the share when tenants compete
     "sk-fresh": {"tenant": "acme", "response_cache": false}}              # its requests skip the response cache

``weight`` is the tenant's weight in the fair share of the inference workers (inference/engine/fair_queue.py):
when tenants compete for a batch, each gets tokens in proportion to it; alone, a tenant gets all. It is a
tenant's, so its keys that give one must agree; those that do not take it (default 1).

``response_cache`` (a boolean, default true) is the key's default for streams' response cache
(streams/response_cache.py): false makes each of its requests opt out (PromptRequest v7
``response_cache``) unless the request itself asks for the cache (``X-Chatpipe-Cache: on`` or a body
``"cache": true``: ``translate.response_cache_of``). It is the key's, not the tenant's: one
application of a tenant may want fresh answers while another of the same tenant takes cached ones.

Who a request belongs to (``resolve_user``; docs/gateway.md "Who may name a user"):

- a **bound** key (``"user"``) acts for that user only, an *identified* user: memory across all
  their conversations. A body ``user`` naming anybody else is a 403 ``user_not_allowed``.
- a **multi-user** key (``"users": "any"``, for an application serving many people) may name any
  user; the name is namespaced, ``<namespace>:<user>`` (``namespace`` default ``key-<hash of the
  key>``), so two keys never share a user by accident. Naming nobody: the key's default user
  ``key-<hash>``, *not identified*.
- a **plain** key (neither) names nobody (a ``user`` is a 403); its requests belong to
  ``key-<hash>``, not identified.

A request of a user that is not identified recalls memory from its own conversation only (the
gateway sets ``PromptRequest.memory_scope`` CONVERSATION): one key serving many people without a
``user`` never mixes their memories. Keys are compared in constant time.

Feedback is accepted only for the key's own requests, without a store shared by gateways: the
request id a gateway hands out is ``<uuid hex><mac>``, the mac an HMAC-SHA256 (truncated to 128 bits)
keyed by a secret derived from the API key, over the request's uuid, user id and conversation id
(``request_id_for`` / ``owns_request``). Any gateway holding the same keys file can check it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from gateway.openai_api import OpenAIError
from schemas.errors import ChatpipeError
from schemas.requests import RequestRuleError, check_share_weight

MULTI_USER = "any"  # the one value of "users" understood today
_MAC_HEX = 32  # 128 bits of HMAC-SHA256: forging one takes ~2^128 tries against the gateway
_UUID_HEX = 32
_SECRET_LABEL = b"chatpipe gateway request-id mac v1"


class KeysFileError(ChatpipeError):
    """The keys file is missing or not in the documented shape."""


@dataclass(frozen=True, slots=True)
class Principal:
    tenant: str
    user_id: str  # default user of the key: its bound user, else key-<hash>
    bound: bool = False  # keys file "user": acts for that one user only
    multi_user: bool = False  # keys file "users": "any": may name any user, under `namespace`
    namespace: str = ""  # prefix of the users a multi-user key names
    share_weight: float = 1.0  # the tenant's weight in the fair share (keys file "weight")
    response_cache: bool = True  # the key's default for streams' response cache (keys file "response_cache")
    mac_secret: bytes = field(default=b"", repr=False)  # derived from the key: request-id MACs


@dataclass(frozen=True, slots=True)
class ResolvedUser:
    user_id: str
    identified: bool  # an end user whose memory spans conversations (bound, or named by a multi-user key)


def default_user(key: str) -> str:
    """``key-<hash>``: the user of a key's requests that name nobody (never the key itself)."""
    return f"key-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def resolve_user(principal: Principal, named: str | None) -> ResolvedUser:
    """Whose request this is: the user ``named`` in the body (None or "" = nobody), as the key allows.

    Raises OpenAIError 403 ``user_not_allowed`` when the key may not name that user.
    """
    if principal.bound:
        if named and named != principal.user_id:
            raise OpenAIError(403, f"this API key is bound to one user and may not act for user {named[:64]!r}; "
                                   "drop `user` (requests of this key are its bound user's) or use that user's key",
                              type="permission_error", param="user", code="user_not_allowed")
        return ResolvedUser(principal.user_id, identified=True)
    if not named:
        return ResolvedUser(principal.user_id, identified=False)
    if principal.multi_user:
        return ResolvedUser(f"{principal.namespace}:{named}", identified=True)
    raise OpenAIError(403, f"this API key may not name users (got user {named[:64]!r}): its keys-file entry has no "
                           '"user" and is not marked "users": "any". Drop `user` (memory then stays within the '
                           'conversation), or mark the key multi-user in the keys file (docs/gateway.md, '
                           '"Who may name a user")', type="permission_error", param="user", code="user_not_allowed")


# -- request ids that say whose request they are ---------------------------------------------------

def request_id_for(principal: Principal, user_id: str, conversation_id: str) -> str:
    """A fresh request id: uuid4 hex + the MAC of (uuid, user, conversation) under the key's secret."""
    base = uuid.uuid4().hex
    return base + _mac(principal, base, user_id, conversation_id)


def owns_request(principal: Principal, request_id: str, user_id: str, conversation_id: str) -> bool:
    """Whether ``request_id`` was handed out for this key, user and conversation (constant-time check)."""
    if len(request_id) != _UUID_HEX + _MAC_HEX or not principal.mac_secret:
        return False
    base, mac = request_id[:_UUID_HEX], request_id[_UUID_HEX:]
    return hmac.compare_digest(mac, _mac(principal, base, user_id, conversation_id))


def _mac(principal: Principal, base: str, user_id: str, conversation_id: str) -> str:
    # length-prefixed fields: ("a", "bc") and ("ab", "c") never give the same message
    message = b"".join(len(p).to_bytes(4, "big") + p for p in (s.encode() for s in (base, user_id, conversation_id)))
    return hmac.new(principal.mac_secret, message, hashlib.sha256).hexdigest()[:_MAC_HEX]


# -- the keys file ------------------------------------------------------------------------------

def principal_of(key: str, value: object, where: str = "keys file") -> Principal:
    """The Principal of one keys-file entry; KeysFileError naming the problem otherwise."""
    name = f"{where}: key {key[:6]}..."
    if isinstance(value, str):
        value = {"tenant": value}
    if not isinstance(value, dict) or not str(value.get("tenant", "")).strip():
        raise KeysFileError(f"{name}: needs a tenant")
    tenant, users, user = str(value["tenant"]), value.get("users"), value.get("user")
    if users is not None and users != MULTI_USER:
        raise KeysFileError(f'{name}: "users" must be "{MULTI_USER}" (a multi-user key), got {users!r}')
    if users is not None and user is not None:
        raise KeysFileError(f'{name}: a key is either bound to one "user" or multi-user ("users": "any"), not both')
    if user is not None and not str(user).strip():
        raise KeysFileError(f'{name}: "user" is empty')
    if "namespace" in value and users is None:
        raise KeysFileError(f'{name}: "namespace" is for multi-user keys ("users": "any")')
    weight = value.get("weight", 1.0)
    try:
        check_share_weight(weight, field='"weight"')
    except RequestRuleError as exc:
        raise KeysFileError(f"{name}: {exc}") from None
    response_cache = value.get("response_cache", True)
    if not isinstance(response_cache, bool):  # a JSON true / false: "false" or 0 would read as something else
        raise KeysFileError(f'{name}: "response_cache" must be true or false, got {response_cache!r}')
    namespace = str(value.get("namespace") or default_user(key))
    if users is not None and (":" in namespace or not namespace.strip()):
        raise KeysFileError(f'{name}: "namespace" must be non-empty and without ":" (got {namespace!r})')
    return Principal(tenant, str(user) if user is not None else default_user(key), bound=user is not None,
                     multi_user=users is not None, namespace=namespace if users is not None else "",
                     share_weight=float(weight), response_cache=response_cache,
                     # the MAC secret, HMAC(key, label): the key itself never keys anything else
                     mac_secret=hmac.new(key.encode(), _SECRET_LABEL, hashlib.sha256).digest())


def check_no_shared_users(entries: dict[str, Principal], where: str = "keys file") -> None:
    """Two multi-user keys of a tenant with one namespace, or a bound user inside a namespace, would
    let two keys act for the same user: refused at load."""
    namespaces: dict[tuple[str, str], str] = {}
    for key, p in entries.items():
        if p.multi_user:
            if (p.tenant, p.namespace) in namespaces:
                raise KeysFileError(f"{where}: keys {namespaces[p.tenant, p.namespace][:6]}... and {key[:6]}... of "
                                    f"tenant {p.tenant!r} share the namespace {p.namespace!r}: give each its own")
            namespaces[p.tenant, p.namespace] = key
    for key, p in entries.items():
        if p.bound and (p.tenant, p.user_id.split(":", 1)[0]) in namespaces and ":" in p.user_id:
            raise KeysFileError(f"{where}: key {key[:6]}...'s bound user {p.user_id!r} lies in the namespace of a "
                                "multi-user key of the same tenant: rename one")


def with_tenant_weights(raw: dict[str, object], entries: dict[str, Principal],
                        where: str = "keys file") -> dict[str, Principal]:
    """Every key of a tenant with the tenant's one ``weight`` (the keys that name it must agree)."""
    named: dict[str, tuple[str, float]] = {}
    for key, value in raw.items():
        if isinstance(value, dict) and "weight" in value:
            p = entries[key]
            if p.tenant in named and named[p.tenant][1] != p.share_weight:
                raise KeysFileError(f"{where}: keys {named[p.tenant][0][:6]}... and {key[:6]}... of tenant {p.tenant!r} "
                                    f"give it different weights ({named[p.tenant][1]:g}, {p.share_weight:g}): a weight "
                                    "is the tenant's; give one, or the same on each")
            named[p.tenant] = (key, p.share_weight)
    return {key: dataclasses.replace(p, share_weight=named[p.tenant][1]) if p.tenant in named else p
            for key, p in entries.items()}


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
        where = f"keys file {path}"
        entries = with_tenant_weights(raw, {key: principal_of(key, value, where) for key, value in raw.items()}, where)
        check_no_shared_users(entries, where)
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

    def key_of(self, fingerprint: str) -> str | None:
        """The key whose ``key_fingerprint`` this is (a batch runs as the key that made it, while it is valid)."""
        for key in self._entries:
            if hmac.compare_digest(key_fingerprint(key), fingerprint):
                return key
        return None


def key_fingerprint(key: str) -> str:
    """SHA-256 (hex) of an API key: what a stored record says of the key that made it, never the key."""
    return hashlib.sha256(key.encode()).hexdigest()
