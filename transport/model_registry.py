"""The model registry on Kafka: ``ModelVersion`` records on the compacted ``chat.models`` topic.

The latest record of a key (``schemas.models.model_key``: ``name@version``) is that version's state;
every change (trained, tainted, promoted) is the whole record again, so a reader needs no history.
Reading is a scan of the topic to its end (``topic_scan``): a registry holds a few records per
version, read whole by ``chatpipe model``, ``chatpipe train`` (the next version number) and the
streams tier's forget agent (which versions an erasure taints). Writing waits for the broker's
acknowledgement (acks=all), so a command that says "published" is telling the truth.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from schemas.codec import AvroCodec, default_codec
from schemas.errors import ChatpipeError, DecodeError
from schemas.models import model_key
from schemas.records import ModelState, ModelVersion, now_ms
from schemas.topics import MODELS
from transport import clients
from transport.topic_scan import read_to_end


class RegistryError(ChatpipeError):
    """A model version that could not be written to ``chat.models``."""


def read_model_versions(kafka: Any, codec: AvroCodec | None = None, timeout_s: float = 30.0) -> dict[str, ModelVersion]:
    """Every version's latest record, by ``name@version``. A tombstone removes its key; a record that
    does not decode is skipped (counted in the returned dict's absence: the registry's writers are ours)."""
    codec = codec or default_codec()
    latest: dict[str, ModelVersion] = {}

    def take(message: Any) -> None:
        key = (message.key() or b"").decode("utf-8", "replace")
        if message.value() is None:
            latest.pop(key, None)
            return
        try:
            latest[key] = codec.decode(message.value(), ModelVersion)
        except DecodeError:
            pass

    read_to_end(kafka, kafka.topic(MODELS), take, timeout_s=timeout_s)
    return latest


def versions_of(versions: dict[str, ModelVersion], name: str) -> list[ModelVersion]:
    """The versions of one name, oldest first."""
    return sorted((v for v in versions.values() if v.name == name), key=lambda v: v.version)


def find_version(versions: dict[str, ModelVersion], ref: str) -> ModelVersion | None:
    """The version ``ref`` names (``name@version``, or ``name``: its newest); None when the registry has none.
    ValueError for a ref that is neither."""
    from schemas.models import parse_model_ref

    name, number = parse_model_ref(ref)
    found = [v for v in versions_of(versions, name) if number is None or v.version == number]
    return found[-1] if found else None


def next_version(versions: dict[str, ModelVersion], name: str) -> int:
    return max((v.version for v in versions_of(versions, name)), default=0) + 1


def publish_model_version(kafka: Any, version: ModelVersion, codec: AvroCodec | None = None,
                          timeout_s: float = 30.0) -> None:
    """Write ``version`` to ``chat.models`` and wait for the broker to have it (RegistryError if not)."""
    codec = codec or default_codec()
    outcome: list = []
    producer = clients.producer(kafka, {"acks": "all", "enable.idempotence": True,
                                        "message.timeout.ms": int(timeout_s * 1000)})
    topic = kafka.topic(MODELS)
    producer.produce(topic, codec.encode(version), model_key(version.name, version.version).encode(),
                     on_delivery=lambda err, _msg: outcome.append(err))
    producer.flush(timeout_s + 5)
    if not outcome or outcome[0] is not None:
        raise RegistryError(f"{model_key(version.name, version.version)} was not stored on {topic} "
                            f"({outcome[0] if outcome else 'no answer'})")


class TransitionError(ChatpipeError):
    """A state change a version's current state does not allow."""


def canary(versions: dict[str, ModelVersion], ref: str, share: float, reason: str, min_rated: int = 0,
           max_drop: float = 0.05, confidence: float = 0.95) -> list[ModelVersion]:
    """The records that put ``ref`` in CANARY with ``share`` of new conversations (a CANARY's share may change),
    with its rollout rule (``min_rated`` 0: none; streams/version_stats.py): declared before it starts."""
    version = _get(versions, ref)
    if not 0 < share <= 1:
        raise TransitionError(f"a canary's share must be in (0, 1], got {share}")
    if min_rated < 0 or not 0 <= max_drop < 1 or not 0.5 <= confidence < 1:
        raise TransitionError(f"a rule needs min_rated >= 0, max_drop in [0, 1), confidence in [0.5, 1); got "
                              f"{min_rated}, {max_drop}, {confidence}")
    _require(version, (ModelState.CANDIDATE, ModelState.CANARY), "canary")
    return [_moved(version, ModelState.CANARY, reason, canary_share=share, rule_min_rated=min_rated,
                   rule_max_drop=max_drop, rule_confidence=confidence)]


def promote(versions: dict[str, ModelVersion], ref: str, reason: str) -> list[ModelVersion]:
    """The records that make ``ref`` LIVE and retire the LIVE versions of its name (for its tenant) it
    replaces. Promoting a RETIRED version is how a LIVE one is rolled back to the one before."""
    version = _get(versions, ref)
    _require(version, (ModelState.CANDIDATE, ModelState.CANARY, ModelState.RETIRED), "promote")
    replaced = [v for v in versions.values() if v.name == version.name and v.tenant == version.tenant
                and v.state is ModelState.LIVE and v.version != version.version]
    return [_moved(version, ModelState.LIVE, reason, canary_share=0.0)] + [
        _moved(v, ModelState.RETIRED, f"replaced by {model_key(version.name, version.version)}") for v in replaced]


def rollback(versions: dict[str, ModelVersion], ref: str, reason: str) -> list[ModelVersion]:
    """The record that takes a CANARY out of service (RETIRED): its conversations go back to the LIVE version."""
    version = _get(versions, ref)
    _require(version, (ModelState.CANARY,), "roll back")
    return [_moved(version, ModelState.RETIRED, reason, canary_share=0.0)]


def _get(versions: dict[str, ModelVersion], ref: str) -> ModelVersion:
    version = versions.get(ref)
    if version is None:
        raise TransitionError(f"no model version {ref} on {MODELS} (`chatpipe model list`)")
    return version


def _require(version: ModelVersion, allowed: tuple[ModelState, ...], action: str) -> None:
    if version.state not in allowed:
        raise TransitionError(f"cannot {action} {model_key(version.name, version.version)}: it is {version.state.value} "
                              f"(only {', '.join(s.value for s in allowed)})")


def _moved(version: ModelVersion, state: ModelState, reason: str, **changes: Any) -> ModelVersion:
    return replace(version, state=state, state_reason=reason, updated_at=now_ms(), **changes)
