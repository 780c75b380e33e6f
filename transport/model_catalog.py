"""Which model answers a request: the versions of ``chat.models`` a tier keeps, and the rules that choose.

A request's ``model`` is one of:

* a base model the fleet serves (``smollm2-135m-instruct``): "the live version for this tenant": the
  tenant's own LIVE version of that base if it has one (a shared-data version, ``tenant`` None, when it
  has none of its own), else the base model itself;
* a version name (``acme-lora``): its LIVE version;
* an exact version (``acme-lora@3``): that one, if it is CANARY or LIVE.

A tenant may only use its own versions and shared ones: another tenant's is ``ModelForbidden`` (403);
a version that is not served is ``ModelNotServed`` (404). In the first two cases a CANARY version of
the same family takes a share of conversations (``ModelVersion.canary_share``): the conversation key
hashed with the canary's ref below the share. The choice is made once per conversation and kept
(``pinned``: the streams tier stores it in the conversation's state) while that version is served, so
a conversation never changes version mid-thread; a version that leaves service (RETIRED, rolled back,
TAINTED, FAILED) releases its conversations to a new choice.

``ModelCatalog`` follows ``chat.models`` (a listener from the end, then one read of the whole topic:
nothing is missed, a record applied twice changes nothing) for the gateway (validation, ``/v1/models``)
and the streams tier (the choice, at intake).
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from schemas.errors import ChatpipeError
from schemas.models import model_key
from schemas.records import ModelState, ModelVersion
from schemas.topics import MODELS
from transport.broadcast import BroadcastListener
from transport.model_registry import read_model_versions
from transport.settings import IDLE_FETCH_WAIT_MS, KafkaSettings

SERVED_STATES = (ModelState.CANARY, ModelState.LIVE)


class ModelChoiceError(ChatpipeError):
    """The request's model cannot be used by its tenant."""

    status = 404
    code = "model_not_found"


class ModelNotServed(ModelChoiceError):
    """No such model, or a version that is not CANARY or LIVE."""


class ModelForbidden(ModelChoiceError):
    """Another tenant's version."""

    status = 403
    code = "model_forbidden"


def ref_of(version: ModelVersion) -> str:
    return model_key(version.name, version.version)


def canary_bucket(conversation_key: str, canary_ref: str) -> float:
    """Where a conversation falls in [0, 1) for one canary: stable, and independent between canaries."""
    digest = hashlib.blake2b(f"{canary_ref}\x00{conversation_key}".encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def may_use(version: ModelVersion, tenant: str) -> bool:
    return version.tenant is None or version.tenant == tenant


@dataclass(frozen=True)
class Family:
    """The versions a plain name rolls out between: the newest LIVE and the newest CANARY."""

    live: ModelVersion | None
    canary: ModelVersion | None
    base_model: str
    name: str | None  # the version name it was asked by; None: by its base model


def family_of(versions: Iterable[ModelVersion], requested: str, tenant: str, base_models: Iterable[str]) -> Family | None:
    """The rollout a plain ``requested`` name means for ``tenant`` (None: ``requested`` names no model)."""
    versions = list(versions)
    named = [v for v in versions if v.name == requested]
    if named:
        mine = [v for v in named if may_use(v, tenant)]
        if not mine:
            raise ModelForbidden(f"the model `{requested}` is another tenant's")
        base, name = named[0].base_model, requested
    elif requested in set(base_models):
        of_base = [v for v in versions if v.base_model == requested]
        own = [v for v in of_base if v.tenant == tenant and v.state in SERVED_STATES]
        mine = own or [v for v in of_base if v.tenant is None]  # the tenant's own rollout, else a shared one
        base, name = requested, None
    else:
        return None
    # the one that entered the state last (asked by a base model, several names may be LIVE: the last promoted)
    newest = lambda state: max((v for v in mine if v.state is state), key=lambda v: (v.updated_at, v.version),
                               default=None)
    return Family(newest(ModelState.LIVE), newest(ModelState.CANARY), base, name)


def choose_model(versions: Iterable[ModelVersion], requested: str, tenant: str, conversation_key: str,
                 base_models: Iterable[str], pinned: str | None = None) -> str:
    """The exact model (a base model or ``name@version``) that answers a conversation's next request."""
    by_ref = {ref_of(v): v for v in versions}
    if "@" in requested:
        version = by_ref.get(requested)
        if version is None:
            raise ModelNotServed(f"the model version `{requested}` does not exist")
        if not may_use(version, tenant):
            raise ModelForbidden(f"the model version `{requested}` is another tenant's")
        if version.state not in SERVED_STATES:
            raise ModelNotServed(f"the model version `{requested}` is {version.state.value}: it is not served")
        return requested
    family = family_of(by_ref.values(), requested, tenant, base_models)
    if family is None:
        raise ModelNotServed(f"the model `{requested}` does not exist")
    if pinned is not None and _still_serves(by_ref, family, pinned):
        return pinned
    canary = family.canary
    if canary is not None and canary_bucket(conversation_key, ref_of(canary)) < canary.canary_share:
        return ref_of(canary)
    return ref_of(family.live) if family.live is not None else family.base_model


def _still_serves(by_ref: dict[str, ModelVersion], family: Family, pinned: str) -> bool:
    """Whether a conversation's earlier choice still answers it: the same base model, or a version still
    served of the name asked for (asked by the base model: of that base)."""
    if "@" not in pinned:
        return family.name is None and pinned == family.base_model
    version = by_ref.get(pinned)
    if version is None or version.state not in SERVED_STATES:
        return False
    return version.name == family.name if family.name is not None else version.base_model == family.base_model


class ModelListener(BroadcastListener):
    """Every ModelVersion record of ``chat.models`` from now on."""

    topic, record_type, thread_name, fetch_wait_ms = MODELS, ModelVersion, "chatpipe-models", IDLE_FETCH_WAIT_MS


class ModelCatalog:
    """The latest record of every version, kept current from ``chat.models``."""

    def __init__(self, kafka: KafkaSettings | None = None, codec: Any = None) -> None:
        self.kafka = kafka
        self._codec = codec
        self._lock = threading.Lock()
        self._versions: dict[str, ModelVersion] = {}
        self.listener: ModelListener | None = None

    def start(self, on_failure: Callable[[BaseException], None],
              on_undecodable: Callable[[Any, Exception], None] | None = None, timeout_s: float = 30.0) -> None:
        """Follow the topic (blocking until the initial read is done)."""
        from schemas.codec import default_codec

        self.listener = ModelListener(self.kafka, self._codec or default_codec())
        self.listener.start(None, self.apply, on_failure, on_undecodable)
        self.listener.ready.wait(10.0)
        for version in read_model_versions(self.kafka, timeout_s=timeout_s).values():
            self.apply(version)

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()

    def apply(self, version: ModelVersion) -> None:
        ref = ref_of(version)
        with self._lock:
            known = self._versions.get(ref)
            if known is None or known.updated_at <= version.updated_at:
                self._versions[ref] = version

    def versions(self) -> list[ModelVersion]:
        with self._lock:
            return list(self._versions.values())

    def choose(self, requested: str, tenant: str, conversation_key: str, base_models: Iterable[str],
               pinned: str | None = None) -> str:
        return choose_model(self.versions(), requested, tenant, conversation_key, base_models, pinned)

    def check(self, requested: str, tenant: str, base_models: Iterable[str]) -> str:
        """``requested`` may be used by ``tenant`` (ModelChoiceError if not). Returns the model whose
        workers can answer it: the exact version when one is named, else the base model."""
        versions = self.versions()
        if "@" in requested:
            return choose_model(versions, requested, tenant, "", base_models)
        family = family_of(versions, requested, tenant, base_models)
        if family is None:
            raise ModelNotServed(f"the model `{requested}` does not exist")
        if requested not in set(base_models) and family.live is None and family.canary is None:
            raise ModelNotServed(f"the model `{requested}` has no CANARY or LIVE version")
        return family.base_model

    def listing(self, tenant: str, base_models: Iterable[str]) -> list[dict[str, Any]]:
        """OpenAI Model objects of what ``tenant`` may ask for: the base models, its served versions,
        and the names (aliases) of its versions that have a LIVE one."""
        served = sorted((v for v in self.versions() if v.state in SERVED_STATES and may_use(v, tenant)),
                        key=lambda v: (v.name, v.version))
        model = lambda id_, created_ms, owner, **extra: {"id": id_, "object": "model", "created": created_ms // 1000,
                                                         "owned_by": owner, **extra}
        out = [model(base, 0, "chatpipe") for base in base_models]
        out += [model(ref_of(v), v.created_at, v.tenant or "shared", state=v.state.value, base_model=v.base_model,
                      **({"canary_share": v.canary_share} if v.state is ModelState.CANARY else {}))
                for v in served]
        live = {v.name: v for v in served if v.state is ModelState.LIVE}
        out += [model(name, v.created_at, v.tenant or "shared", alias_of=ref_of(v)) for name, v in sorted(live.items())]
        return out
