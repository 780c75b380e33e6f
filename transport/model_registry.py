"""The model registry on Kafka: ``ModelVersion`` records on the compacted ``chat.models`` topic.

The latest record of a key (``schemas.models.model_key``: ``name@version``) is that version's state;
every change (trained, tainted, promoted) is the whole record again, so a reader needs no history.
Reading is a scan of the topic to its end (``topic_scan``): a registry holds a few records per
version, read whole by ``chatpipe model``, ``chatpipe train`` (the next version number) and the
streams tier's forget agent (which versions an erasure taints). Writing waits for the broker's
acknowledgement (acks=all), so a command that says "published" is telling the truth.
"""

from __future__ import annotations

from typing import Any

from schemas.codec import AvroCodec, default_codec
from schemas.errors import ChatpipeError, DecodeError
from schemas.models import model_key
from schemas.records import ModelVersion
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
