"""The model versions a worker serves: it follows ``chat.models`` and holds every version of its base
model whose record says CANARY or LIVE.

For such a version the worker copies the adapter's files from the artifact store (``adapter_uri``: a
folder or any fsspec URI) into its adapter cache, checks the weights' sha256 against the record's
``adapter_sha256``, checks the factors against the model (``Engine.check_adapter``: readable, shapes of
this model, a supported kind) and registers the adapter with the engine under ``name@version``; the
engine reads it into memory when a request first names it. Failure policy: a version whose artifact is
missing, corrupt or unservable is the version's fault (FAILED below); a store that cannot be reached is
the infrastructure's (the follower's thread dies, the worker exits non-zero, a restart tries again).
A version whose record moves to any other state (RETIRED, TAINTED, FAILED, back to CANDIDATE) is retired in the engine: no new request runs
with it, the ones running finish. A version that fails a check is marked FAILED on ``chat.models``
with the reason (a whole new record, as every state change) and in the worker's log; the worker
serves everything else as before.

A request names a version in ``InferenceRequest.model`` (``name@version``); anything without ``@``
is the base model. ``adapter_for`` answers which adapter serves a request, waiting a while for a
version whose record this worker has seen but whose files are still being fetched (a gateway may
route to a version a moment before every worker holds it), and refuses one it does not serve with
the reason (``ModelVersionError``: a dead letter, never a crash).

Reading: the listener tails the topic from its end first, then the whole topic is read once
(``read_model_versions``) and applied: nothing written in between is missed, and applying a record
twice changes nothing (the same pattern as the streams tier's erasure registry).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from inference.engine.lora import AdapterError
from inference.worker.errors import BadRequestError
from schemas.models import ADAPTER_WEIGHTS, model_key
from schemas.records import ModelState, ModelVersion, now_ms
from schemas.topics import MODELS
from transport.artifacts import ArtifactError, fetch_files, sha256_files
from transport.model_catalog import SERVED_STATES, ModelListener
from transport.model_registry import RegistryError, publish_model_version, read_model_versions
from transport.settings import KafkaSettings

log = logging.getLogger(__name__)

ADAPTER_FILES = ["adapter_config.json", ADAPTER_WEIGHTS]


class ModelVersionError(BadRequestError):
    """The request names a model version this worker does not serve (unknown, not CANARY or LIVE, failed)."""

    error_code = "model_not_found"


class ServedVersions:
    def __init__(self, kafka: KafkaSettings, codec: Any, engine: Any, base_model: str, cache_dir: Path,
                 wait_s: float = 30.0) -> None:  # fmt: skip
        self.kafka = kafka
        self.engine = engine  # inference.engine.Engine: check_adapter, register_adapter, retire_adapter
        self.base_model = base_model  # ModelVersion.base_model of the versions this worker can serve
        self.cache_dir = Path(cache_dir)
        self.wait_s = wait_s
        self.listener = ModelListener(kafka, codec)
        self._lock = threading.Lock()  # the maps below (read by the loop, written by the follower)
        self._applying = threading.Lock()  # one record at a time: the listener's and the initial scan's
        self._records: dict[str, ModelVersion] = {}  # name@version -> its latest record (of this base model)
        self._held: dict[str, Path] = {}  # name@version -> its local adapter folder, registered with the engine
        self._failed: dict[str, str] = {}  # name@version -> why this worker could not serve it

    # -- following chat.models ---------------------------------------------------------------------

    def start(self, on_failure: Callable[[BaseException], None],
              on_undecodable: Callable[[Any, Exception], None] | None = None) -> None:
        """Start following (blocking: the initial read of the whole topic and the versions' loads)."""
        self.listener.start(None, self.apply, on_failure, on_undecodable)
        self.listener.ready.wait(10.0)
        for version in read_model_versions(self.kafka).values():
            self.apply(version)

    def close(self) -> None:
        self.listener.close()

    def apply(self, version: ModelVersion) -> None:
        """One record of ``chat.models``: load, or retire, what it says (the listener's thread)."""
        if version.base_model != self.base_model:
            return  # another base model's version: other workers serve it
        with self._applying:
            self._apply(version)

    def _apply(self, version: ModelVersion) -> None:
        ref = model_key(version.name, version.version)
        with self._lock:
            known = self._records.get(ref)
            if known is not None and known.updated_at > version.updated_at:
                return  # an older record read again by the initial scan
            self._records[ref] = version
            held = ref in self._held
        if version.state in SERVED_STATES and not held:
            self._load(ref, version)
        elif version.state not in SERVED_STATES and held:
            self.engine.retire_adapter(ref)
            with self._lock:
                self._held.pop(ref, None)
            log.info("model version %s retired (%s): no new requests run with it", ref, version.state.value)

    def _load(self, ref: str, version: ModelVersion) -> None:
        started = time.monotonic()
        try:
            folder = fetch_files(version.adapter_uri, ADAPTER_FILES, self.cache_dir / version.name / str(version.version))
            digest = sha256_files([folder / ADAPTER_WEIGHTS])
            if digest != version.adapter_sha256:
                raise ArtifactError(f"the adapter's {ADAPTER_WEIGHTS} has sha256 {digest[:16]}..., the record says "
                                    f"{version.adapter_sha256[:16]}... (corrupt or replaced in the store)")
            self.engine.check_adapter(folder)
            self.engine.register_adapter(ref, folder)
        except (ArtifactError, AdapterError) as exc:  # the version's own fault: FAILED, for every worker
            self._mark_failed(ref, version, f"{type(exc).__name__}: {exc}")
            return
        # Anything else (the store unreachable, the cache folder unwritable) is the infrastructure's: it
        # propagates to the follower's thread, the worker stops non-zero and its restart tries again.
        with self._lock:
            self._held[ref] = folder
            self._failed.pop(ref, None)
        log.info("model version %s (%s) held in %.2f s from %s", ref, version.state.value,
                 time.monotonic() - started, version.adapter_uri)

    def _mark_failed(self, ref: str, version: ModelVersion, reason: str) -> None:
        with self._lock:
            self._failed[ref] = reason
        log.error("model version %s cannot be served: %s; marked FAILED on %s", ref, reason, MODELS)
        failed = replace(version, state=ModelState.FAILED, state_reason=f"worker: {reason}", updated_at=now_ms())
        try:
            publish_model_version(self.kafka, failed)
        except RegistryError as exc:  # the log says it; the version stays unserved here either way
            log.error("model version %s: the FAILED record was not written: %s", ref, exc)

    # -- serving -----------------------------------------------------------------------------------

    def pending(self) -> list[str]:
        """Versions whose CANARY/LIVE record this worker has seen but that it neither holds nor failed."""
        with self._lock:
            return sorted(ref for ref, v in self._records.items()
                          if v.state in SERVED_STATES and ref not in self._held and ref not in self._failed)

    def held(self) -> list[str]:
        """The versions this worker serves now (its heartbeat's ``model_versions``)."""
        with self._lock:
            return sorted(self._held)

    async def adapter_for(self, model: str) -> str | None:
        """The engine adapter of a request for ``model``: None for the base model, else ``model``
        itself once held. ``ModelVersionError`` for a version this worker does not serve."""
        if "@" not in model:
            return None
        deadline = time.monotonic() + self.wait_s
        while True:
            with self._lock:
                if model in self._held:
                    return model
                record, failed = self._records.get(model), self._failed.get(model)
            loading = record is not None and record.state in SERVED_STATES and failed is None
            if not loading or time.monotonic() >= deadline:
                raise ModelVersionError(self._why_not(model, record, failed))
            await asyncio.sleep(0.05)

    def _why_not(self, model: str, record: ModelVersion | None, failed: str | None) -> str:
        if failed is not None:
            return f"model version {model} failed to load on this worker: {failed}"
        if record is None:
            return (f"model version {model} is not on {MODELS} for this worker's base model {self.base_model} "
                    f"(`chatpipe model list` shows the versions)")
        if record.state in SERVED_STATES:
            return f"model version {model} is still loading after {self.wait_s:.0f} s"
        return f"model version {model} is {record.state.value} on {MODELS}: it is not served"
