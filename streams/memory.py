"""Conversation memory: past turns as vectors in Qdrant, recalled by similarity weighted by recency.

For: storing each answered turn (``upsert``), finding the past turns of the same tenant AND user
(AND conversation, for a request whose user is not identified: ``RecallQuery.conversation_id``)
that best match a new prompt (``recall_many``), forgetting a user or a conversation
(``forget``). Not for: embedding text (``streams.embeddings``), recent-window state (the Faust
table), or deciding what fits the context (``streams.context``).

Layout (docs/memory.md):

- **Server mode** (``settings.url``): one collection, cosine distance, keyword payload indexes on
  ``tenant`` (``is_tenant``: Qdrant co-locates each tenant's points), ``user_id`` and
  ``conversation_id``. A call that fails for a transient reason (``transport.failures.classify``:
  connection refused/reset, timeouts, HTTP 5xx or 429, as while a cluster peer dies) moves the
  memory on to the next peer when ``url`` lists several, and is retried by a
  ``transport.failures.Retrier`` (the budget: ``retries`` waits from ``retry_backoff_s``, doubling,
  at most 2 s); when it is spent the call raises ``MemoryUnavailableError`` naming the URL(s).
  ``retry_calls=False`` (the streams tier, whose own ``Retrier`` holds the one budget around
  every memory call) makes one attempt per call after the collection is set up.
- **Local mode** (the default, ``QdrantClient(path=...)``): qdrant-client's local mode ignores
  payload indexes and evaluates a filter in Python point by point (~13 us per point here), so one
  collection of 100k turns costs >1 s per recall. Each (tenant, user) pair is therefore hashed to
  one of ``local_partitions`` collections named ``<collection>.<N>.<i>``; a recall touches one of
  them (~N/partitions points) and still filters on tenant and user inside it. Its SQLite files
  are switched to write-ahead logging (``streams.memory_local``: why, and what it costs).

Recall ranking: Qdrant returns the ``recall_candidates`` most similar turns of that tenant+user
with cosine >= ``min_score``; they are re-ranked by
``score = similarity * 0.5 ** (age_s / recency_half_life_s)`` (``recency_weighted``), ties going
to the newer turn. Point ids are UUIDv5 of the turn id, so an upsert repeated after a crash
overwrites instead of duplicating.

Calls block: from asyncio, run them in a thread (``StreamsServices.in_memory_thread``).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from qdrant_client import QdrantClient, models
from qdrant_client.http.exceptions import UnexpectedResponse

from schemas.errors import ChatpipeError
from streams.memory_local import open_files_problem, partition_of, partition_prefix, stored_partitions, tune_storage
from streams.memory_settings import MemorySettings
from transport.failures import Fault, Retrier, classify

# Namespace of the point ids: uuid5(_POINT_NAMESPACE, turn_id). Never change it: stored points
# would no longer be found (and overwritten) by their turn id.
_POINT_NAMESPACE = uuid.UUID("6f1c1c52-6d3e-4b55-9b1a-6f7c1d0c8e21")
_MAX_BACKOFF_S = 2.0


class ConversationMemoryError(ChatpipeError):
    """Root of the memory's errors."""


class MemoryUnavailableError(ConversationMemoryError):
    """Qdrant cannot be reached (server down, the retry budget spent) or the local folder is locked."""

    fault = Fault.TRANSIENT


class MemoryRequestError(ConversationMemoryError):
    """The Qdrant server refused a request (HTTP 4xx): a bug or a mismatched server, not an outage.
    Not the record's fault either: the tier retries it, then stops rather than ack."""

    fault = Fault.TRANSIENT


class MemoryInputError(ConversationMemoryError):
    """Vectors or keys handed to the memory that it cannot store or search with."""


class MemoryLayoutError(ConversationMemoryError):
    """What is stored does not match the settings (vector size, number of local partitions)."""


@dataclass(frozen=True, slots=True)
class StoredTurn:
    turn_id: str  # ConversationTurn.event_id; the point id is uuid5 of it
    tenant: str
    user_id: str
    conversation_id: str
    turn_index: int
    prompt: str
    answer: str
    created_at: int  # epoch ms


@dataclass(frozen=True, slots=True)
class RecalledTurn:
    turn: StoredTurn
    similarity: float  # cosine of the query and the turn's vector
    score: float  # similarity weighted by recency: what the ranking used


@dataclass(frozen=True, slots=True)
class RecallQuery:
    tenant: str
    user_id: str
    vector: np.ndarray  # [dim] float32
    exclude_turn_ids: Collection[str] = ()
    limit: int | None = None  # None = settings.recall_limit
    now_ms: int | None = None  # None = the wall clock
    # Only this conversation's turns (a request whose user is not identified, MemoryScope
    # CONVERSATION); None = every conversation of the tenant's user.
    conversation_id: str | None = None


def point_id(turn_id: str) -> str:
    """The Qdrant point id of a turn: deterministic, so upserting a turn twice stores it once."""
    return str(uuid.uuid5(_POINT_NAMESPACE, turn_id))


def recency_weighted(similarity: float, created_at_ms: int, now_ms: int, half_life_s: float) -> float:
    """``similarity * 0.5 ** (age / half_life)``; a turn from the future (clock skew) counts as new."""
    age_s = max(0, now_ms - created_at_ms) / 1000.0
    return similarity * 0.5 ** (age_s / half_life_s)


def _budget_s(retries: int, backoff_s: float) -> float:
    """The time ``retries`` waits take: backoff from ``backoff_s``, doubling, at most ``_MAX_BACKOFF_S``."""
    return sum(min(backoff_s * 2 ** i, _MAX_BACKOFF_S) for i in range(retries))


class _MemoryRetrier(Retrier):
    """The memory's own retries are for an outage (the next peer may answer). A refusal
    (``MemoryRequestError``, a 4xx) goes to the caller at once, as before the shared Retrier: the
    "already exists" of a collection another worker just created is answered there, and the tier's
    budget decides the rest."""

    error = MemoryUnavailableError

    def _after(self, what: str, exc: Exception, state: list[float]) -> float | None:
        if isinstance(exc, MemoryRequestError):
            return None
        return super()._after(what, exc, state)


class ConversationMemory:
    """Past turns of every tenant and user, in Qdrant local mode or on a Qdrant server/cluster."""

    def __init__(self, settings: MemorySettings, dim: int, *, retry_calls: bool = True) -> None:
        if dim < 1:
            raise MemoryInputError(f"vector size must be positive, got {dim}")
        self.settings = settings
        self.dim = dim
        self.local = settings.url is None
        self.where = str(settings.path) if self.local else settings.url
        self._lock = threading.RLock()  # local mode's in-process store is not thread-safe
        self._closed = False
        self.retrier = _MemoryRetrier(_budget_s(settings.retries, settings.retry_backoff_s), settings.retry_backoff_s,
                                      _MAX_BACKOFF_S)
        self._retry_calls = True  # setting the collection up retries, whatever retry_calls says
        if self.local:
            if problem := open_files_problem(settings.local_partitions):
                raise MemoryLayoutError(problem)
            try:
                settings.path.mkdir(parents=True, exist_ok=True)
                self._client = QdrantClient(path=str(settings.path))
            except RuntimeError as exc:  # the folder's lock is held by another process
                raise MemoryUnavailableError(f"Qdrant local folder {settings.path}: {exc}") from exc
            self._partitions = self._existing_partitions()
        else:
            api_key = settings.api_key.get_secret_value() if settings.api_key else None
            urls = [u.strip() for u in settings.url.split(",") if u.strip()]
            if not urls:
                raise MemoryInputError(f"no Qdrant URL in {settings.url!r}")
            # one client per listed peer; a transient failure moves the next attempt to the next peer
            self._peers = [QdrantClient(url=u, api_key=api_key, timeout=settings.timeout_s,
                                        check_compatibility=False) for u in urls]
            self._client = self._peers[0]
            try:
                self._ensure_server_collection()
            except Exception:
                self.close()
                raise
        self._retry_calls = retry_calls

    # -- writing ---------------------------------------------------------------------------------

    def upsert(self, turns: Sequence[StoredTurn], vectors: np.ndarray) -> None:
        """Store ``turns`` with their ``vectors`` [N, dim]; a turn id stored before is overwritten."""
        if not turns and np.size(vectors) == 0:
            return
        vectors = self._check_matrix(vectors, len(turns))
        groups: dict[str, list[int]] = defaultdict(list)
        for i, turn in enumerate(turns):
            self._check_keys(turn.tenant, turn.user_id)
            groups[self._collection_of(turn.tenant, turn.user_id)].append(i)
        for name, rows in groups.items():
            if self.local:
                self._ensure_partition(name)
            batch = models.Batch(
                ids=[point_id(turns[i].turn_id) for i in rows],
                vectors=vectors[rows].tolist(),
                payloads=[asdict(turns[i]) for i in rows],
            )
            self._call("upsert", "upsert", collection_name=name, points=batch, wait=True)

    def forget(self, *, tenant: str, user_id: str, conversation_id: str | None = None) -> int:
        """Delete every turn of the user (or of one conversation of theirs); returns how many."""
        self._check_keys(tenant, user_id)
        if conversation_id == "":
            raise MemoryInputError("forget: conversation_id is empty (None forgets the whole user)")
        name = self._collection_of(tenant, user_id)
        if self.local and name not in self._partitions:
            return 0
        flt = _filter(tenant=tenant, user_id=user_id, conversation_id=conversation_id)
        # count, then delete by the same filter: a turn stored in between is deleted too, just not counted
        found = self._call("count", "count", collection_name=name, count_filter=flt, exact=True).count
        if found:
            self._call("delete", "delete", collection_name=name,
                       points_selector=models.FilterSelector(filter=flt), wait=True)
        return found

    def delete_turns(self, turns: Sequence[StoredTurn]) -> None:
        """Delete these turns' points (by id; those never stored are no error)."""
        groups: dict[str, list[str]] = defaultdict(list)
        for turn in turns:
            self._check_keys(turn.tenant, turn.user_id)
            groups[self._collection_of(turn.tenant, turn.user_id)].append(point_id(turn.turn_id))
        for name, ids in groups.items():
            if self.local and name not in self._partitions:
                continue
            self._call("delete", "delete", collection_name=name, points_selector=models.PointIdsList(points=ids),
                       wait=True)

    # -- reading ---------------------------------------------------------------------------------

    def recall_many(self, queries: Sequence[RecallQuery]) -> list[list[RecalledTurn]]:
        """For each query, the user's past turns (of one conversation when ``conversation_id`` is given)
        closest to its vector, weighted by recency, best ``score`` first; in one batched Qdrant call per
        collection touched."""
        results: list[list[RecalledTurn]] = [[] for _ in queries]
        groups: dict[str, list[int]] = defaultdict(list)
        requests: dict[int, models.QueryRequest] = {}
        for i, q in enumerate(queries):
            self._check_keys(q.tenant, q.user_id)
            if q.conversation_id == "":
                raise MemoryInputError("recall: conversation_id is empty (None recalls every conversation)")
            vector = self._check_matrix(np.asarray(q.vector).reshape(1, -1), 1)[0]
            limit = self.settings.recall_limit if q.limit is None else q.limit
            if limit < 0:
                raise MemoryInputError(f"recall limit must be >= 0, got {limit}")
            name = self._collection_of(q.tenant, q.user_id)
            if limit == 0 or (self.local and name not in self._partitions):
                continue
            requests[i] = models.QueryRequest(
                query=vector.tolist(),
                filter=_filter(tenant=q.tenant, user_id=q.user_id, conversation_id=q.conversation_id),
                # excluded turns are dropped here, not by a must_not filter: local mode would test
                # that condition on every point of the user in Python
                limit=max(limit, self.settings.recall_candidates) + len(q.exclude_turn_ids),
                score_threshold=self.settings.min_score,
                with_payload=True,
            )
            groups[name].append(i)
        for name, idx in groups.items():
            answers = self._call("query", "query_batch_points", collection_name=name,
                                 requests=[requests[i] for i in idx])
            for i, answer in zip(idx, answers, strict=True):
                results[i] = self._rank(queries[i], answer.points)
        return results

    def count(self, *, tenant: str | None = None, user_id: str | None = None,
              conversation_id: str | None = None) -> int:
        """How many turns are stored, all of them or those matching every key given."""
        flt = _filter(tenant=tenant, user_id=user_id, conversation_id=conversation_id)
        if not self.local:
            names = [self.settings.collection]
        elif tenant is not None and user_id is not None:
            names = [n for n in [self._collection_of(tenant, user_id)] if n in self._partitions]
        else:
            names = sorted(self._partitions)
        return sum(self._call("count", "count", collection_name=n, count_filter=flt,
                              exact=True).count for n in names)

    def close(self) -> None:
        """Release the client (and local mode's folder lock). Safe to call twice."""
        with self._lock:
            if not self._closed:
                self._closed = True
                for client in self._peers if not self.local else [self._client]:
                    client.close()

    # -- internals -------------------------------------------------------------------------------

    def _rank(self, query: RecallQuery, points: Sequence[models.ScoredPoint]) -> list[RecalledTurn]:
        now_ms = int(time.time() * 1000) if query.now_ms is None else query.now_ms
        limit = self.settings.recall_limit if query.limit is None else query.limit
        excluded = set(query.exclude_turn_ids)
        recalled = []
        for p in points:
            turn = _turn(p.payload or {})
            # tenant, user (and conversation): the filter did it; checked again because a leak here
            # crosses tenants, users or the conversations of one key's many people
            if turn.tenant != query.tenant or turn.user_id != query.user_id or turn.turn_id in excluded:
                continue
            if query.conversation_id is not None and turn.conversation_id != query.conversation_id:
                continue
            score = recency_weighted(p.score, turn.created_at, now_ms, self.settings.recency_half_life_s)
            recalled.append(RecalledTurn(turn=turn, similarity=p.score, score=score))
        recalled.sort(key=lambda r: (r.score, r.turn.created_at, r.turn.turn_id), reverse=True)
        return recalled[:limit]

    def _collection_of(self, tenant: str, user_id: str) -> str:
        if not self.local:
            return self.settings.collection
        return partition_of(self.settings.collection, self.settings.local_partitions, tenant, user_id)

    def _existing_partitions(self) -> set[str]:
        ours = stored_partitions(self._client, self.settings.collection)
        prefix = partition_prefix(self.settings.collection, self.settings.local_partitions)
        foreign = sorted(n for n in ours if not n.startswith(prefix))
        if foreign:
            raise MemoryLayoutError(
                f"{self.settings.path} holds collections of another local_partitions setting ({foreign[0]}); "
                f"set CHATPIPE_MEMORY_LOCAL_PARTITIONS to the number in that name or use a fresh folder")
        for name in sorted(ours)[:1]:
            self._check_size(name)
        for name in ours:
            tune_storage(self._client, name)
        return ours

    def _ensure_partition(self, name: str) -> None:
        with self._lock:  # two threads storing a new user's first turns must not both create it
            if name not in self._partitions:
                self._client.create_collection(name, vectors_config=self._vector_params())
                tune_storage(self._client, name)
                self._partitions.add(name)

    def _ensure_server_collection(self) -> None:
        name = self.settings.collection
        if not self._call("collection_exists", "collection_exists", name):
            try:
                self._call("create_collection", "create_collection", name,
                           vectors_config=self._vector_params(), shard_number=self.settings.shards,
                           replication_factor=self.settings.replication_factor)
            except MemoryRequestError as exc:  # another worker created it first
                if "already exists" not in str(exc):
                    raise
        self._check_size(name)
        indexed = self._call("get_collection", "get_collection", name).payload_schema
        for field in ("tenant", "user_id", "conversation_id"):
            if field not in indexed:
                # is_tenant: Qdrant stores each tenant's points together, so a tenant's search reads less
                schema = models.KeywordIndexParams(type=models.KeywordIndexType.KEYWORD, is_tenant=field == "tenant")
                self._call("create_payload_index", "create_payload_index", name, field,
                           field_schema=schema, wait=True)

    def _check_size(self, name: str) -> None:
        params = self._call("get_collection", "get_collection", name).config.params.vectors
        size = params.size if isinstance(params, models.VectorParams) else None
        if size != self.dim:
            raise MemoryLayoutError(f"collection {name} at {self.where} stores vectors of size {size}, the "
                                    f"embedding model makes {self.dim}: use another collection or path")

    def _vector_params(self) -> models.VectorParams:
        return models.VectorParams(size=self.dim, distance=models.Distance.COSINE)

    def _check_matrix(self, vectors: np.ndarray, rows: int) -> np.ndarray:
        vectors = np.asarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape != (rows, self.dim):
            raise MemoryInputError(f"expected vectors of shape ({rows}, {self.dim}), got {vectors.shape}")
        if not np.isfinite(vectors).all():
            raise MemoryInputError("vectors contain NaN or infinity")
        return vectors

    @staticmethod
    def _check_keys(tenant: str, user_id: str) -> None:
        if not tenant or not user_id:
            raise MemoryInputError(f"tenant and user_id must be non-empty (got {tenant!r}, {user_id!r})")

    def _call(self, what: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """``client.<method>(...)``; on a server, within the retry budget unless ``retry_calls`` is off."""
        if self._closed:
            raise MemoryUnavailableError(f"memory at {self.where} is closed")
        if self.local:
            with self._lock:
                return getattr(self._client, method)(*args, **kwargs)
        if not self._retry_calls:
            return self._attempt(what, method, *args, **kwargs)
        return self.retrier.call_blocking(f"Qdrant at {self.where}: {what}", self._attempt, what, method,
                                          *args, **kwargs)

    def _attempt(self, what: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """One call on the current peer; a transient failure moves the next call on to the next listed
        peer (round robin; one URL = the same peer) and is raised as it is, for the retrier."""
        client = self._client
        try:
            return getattr(client, method)(*args, **kwargs)
        except Exception as exc:
            if classify(exc) is not Fault.TRANSIENT:
                if isinstance(exc, UnexpectedResponse):
                    raise MemoryRequestError(
                        f"Qdrant at {self.where} refused {what}: HTTP {exc.status_code} "
                        f"{exc.content[:300].decode(errors='replace')}") from exc
                raise
            with self._lock:  # several threads may fail at once: move on by one peer only
                if self._client is client:
                    self._client = self._peers[(self._peers.index(client) + 1) % len(self._peers)]
            raise


def _filter(**keys: str | None) -> models.Filter | None:
    """The payload filter matching every key given (None: not filtered on); None when none is given."""
    must: list[models.Condition] = [models.FieldCondition(key=k, match=models.MatchValue(value=v))
                                    for k, v in keys.items() if v is not None]
    return models.Filter(must=must) if must else None


def _turn(payload: dict[str, Any]) -> StoredTurn:
    return StoredTurn(turn_id=payload["turn_id"], tenant=payload["tenant"], user_id=payload["user_id"],
                      conversation_id=payload["conversation_id"], turn_index=int(payload["turn_index"]),
                      prompt=payload["prompt"], answer=payload["answer"], created_at=int(payload["created_at"]))
