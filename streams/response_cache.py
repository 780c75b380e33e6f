"""The response cache: whole answers kept in Redis, looked up after the context is assembled.

An answer depends on the assembled context (recalled memory, recent turns, the system prompt with
the tools), not only on the request, so the lookup happens in streams intake once each prompt's
``InferenceRequest`` is built, and the key is a hash of what the worker would compute from:
the tenant, the exact model version, the assembled messages (or the raw prompt) and every sampling
field (``response_format`` carries the tools' and JSON schemas' constraint; ``seed``, ``max_tokens``,
``stop``, the penalties: all of them, so two requests share an entry only when a worker would be given
the same input). Two users of one tenant asking the same question with different memories get
different contexts, so different keys; two tenants never share one (the tenant is hashed in and
names the key's namespace).

Only a request whose output is a function of its key is cacheable: greedy (temperature 0) or a fixed
``seed``, one choice, no logprobs (an entry keeps the text, not per-token logprobs), and not opted out
(PromptRequest v7 ``response_cache``: the gateway's ``X-Chatpipe-Cache: off``, ``extra_body`` ``cache``,
or its key's default). Every other request bypasses it, counted by reason.

**Entries** are written by the record agent from the Response of a miss (``Record``: after its
turn is on the broker, answers that ended STOP or LENGTH only), never by a worker: the key was
computed in streams, and the record agent already drops answers of users erased meanwhile. An
entry is a JSON string under ``<prefix>cache:<tenant tag>:e:<sha256>`` with ``EX ttl_s``; the key
is added to its owner's index set ``<prefix>cache:<tenant tag>:u:<user tag>``, so an erasure deletes
a user's entries without a scan.

**Hits are checked before they are served**: the entry's model version must not be retired
(``<prefix>cache:retired``: ``retire_version``; once ``chat.models`` exists its follower calls it, until
then ``chatpipe cache retire MODEL``), and the entry's owner must not have been erased after it was
written (the erasure registry, as memory's writer checks: an index set evicted by ``allkeys-lru``
or a delete that has not happened yet never lets an erased user's answer out).

**Redis is an enhancement, never a dependency.** Every call has one budget, ``timeout_s`` (100 ms;
a local Redis answers in well under 1 ms, one pipelined round trip per intake batch); a call that
fails or times out bypasses the cache (``unavailable``, counted) for ``retry_after_s``, after which
it is tried again. Only an erasure insists: ``erase_user`` raises ``CacheUnavailableError`` (an
outage, retried within forget's budget) so a deletion is never acknowledged with the user's entries left.

redis-py's asyncio client (the library made for it: pipelining, TLS for ``rediss://``, AUTH) with its
own retries off: the budget here is the one retry policy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Iterable

from schemas.records import FinishReason, InferenceRequest, PromptRequest
from streams.cache_settings import CacheSettings

log = logging.getLogger(__name__)

#: The worker_id of chunks, Responses and turns answered from the cache (no worker ran).
CACHE_WORKER_ID = "streams.response-cache"
CACHED = (FinishReason.STOP, FinishReason.LENGTH)  # answers worth keeping (not errors, cancels, timeouts)
# Bypass reasons (chatpipe_streams_response_cache_bypasses_total{reason})
OPTED_OUT, SAMPLED, CHOICES, LOGPROBS, UNAVAILABLE = "opted_out", "sampled", "n", "logprobs", "unavailable"


class CacheUnavailableError(ConnectionError):
    """Redis did not answer a call that may not be skipped (an erasure): a ``ConnectionError``, so the
    failure policy (``transport.failures.classify``) counts it TRANSIENT and forget's budget retries it."""


def model_version(request: InferenceRequest) -> str:
    """The exact model version that will answer ``request``: intake has chosen it (a base model or
    ``name@version``, transport/model_catalog.py); the key and the entry carry it."""
    return request.model


def bypass_reason(prompt: PromptRequest, request: InferenceRequest) -> str | None:
    """Why ``request`` may not be answered from the cache (None: it may)."""
    sampling = request.sampling
    if not prompt.response_cache:
        return OPTED_OUT
    if sampling.n != 1:
        return CHOICES
    if sampling.logprobs:
        return LOGPROBS
    if sampling.temperature > 0 and sampling.seed is None:
        return SAMPLED
    return None


def key_digest(request: InferenceRequest, version: str) -> str:
    """sha256 of everything the answer is a function of (module docstring)."""
    material = {"tenant": request.tenant, "model": version, "raw_prompt": request.raw_prompt,
                "messages": [[m.role, m.content] for m in request.messages], "sampling": asdict(request.sampling)}
    return hashlib.sha256(json.dumps(material, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def _tag(*parts: str) -> str:
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class CachedAnswer:
    """One entry: the answer and whose request it came from (for erasure)."""

    text: str
    finish_reason: str
    tokens_in: int
    tokens_out: int
    model: str  # the exact version that computed it
    tenant: str
    user_id: str  # the owner: the user whose request was computed
    conversation_id: str
    created_at: int  # the owner's prompt, epoch ms (an erasure at or after it hides the entry)
    request_id: str
    stored_at: int

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), ensure_ascii=False).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "CachedAnswer":
        return cls(**json.loads(data))


@dataclass(frozen=True, slots=True)
class CacheKey:
    tenant: str
    digest: str
    version: str


class CacheLayout:
    """Where the cache's keys are (module docstring): shared by the asyncio cache and the sync view."""

    def __init__(self, settings: CacheSettings) -> None:
        self.settings = settings
        self.prefix = f"{settings.key_prefix}cache:"

    def entry_key(self, key: CacheKey) -> str:
        return f"{self.prefix}{_tag(key.tenant)}:e:{key.digest}"

    def user_index(self, tenant: str, user_id: str) -> str:
        return f"{self.prefix}{_tag(tenant)}:u:{_tag(tenant, user_id)}"

    def tenant_entries_pattern(self, tenant: str) -> str:
        return f"{self.prefix}{_tag(tenant)}:e:*"

    @property
    def retired_key(self) -> str:
        return f"{self.prefix}retired"

    def client_options(self, for_asyncio: bool) -> dict[str, Any]:
        """redis-py's options for ``settings``: the one budget per call, redis-py's own retries off."""
        from redis.backoff import NoBackoff

        if for_asyncio:
            from redis.asyncio.retry import Retry
        else:
            from redis.retry import Retry  # type: ignore[assignment]
        s = self.settings
        return dict(password=s.password.get_secret_value() if s.password else None, socket_timeout=s.timeout_s,
                    socket_connect_timeout=s.timeout_s, retry=Retry(NoBackoff(), 0), health_check_interval=0)


class ResponseCache(CacheLayout):
    """Lookups, stores and erasures on one Redis; every outcome counted per tenant (read by /metrics)."""

    def __init__(self, settings: CacheSettings, client: Any = None) -> None:
        super().__init__(settings)
        self._client = client  # redis.asyncio.Redis, made on first use (inside the worker's event loop)
        self._down_until = 0.0
        self.hits: Counter[str] = Counter()  # by tenant
        self.misses: Counter[str] = Counter()
        self.bypasses: Counter[tuple[str, str]] = Counter()  # (tenant, reason)
        self.stored = 0
        self.store_failures = 0
        self.hidden = 0  # entries found but not served: a retired version, an owner erased since
        self.erased_entries = 0

    def key_for(self, prompt: PromptRequest, request: InferenceRequest) -> CacheKey | None:
        """The request's key, or None when it bypasses the cache (counted)."""
        reason = bypass_reason(prompt, request)
        if reason is not None:
            self.bypasses[(request.tenant, reason)] += 1
            return None
        version = model_version(request)
        return CacheKey(request.tenant, key_digest(request, version), version)

    # --- the client -----------------------------------------------------------------------------
    def client(self) -> Any:
        if self._client is None:
            import redis.asyncio as aioredis

            self._client = aioredis.Redis.from_url(self.settings.url, **self.client_options(for_asyncio=True))
        return self._client

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, exc: BaseException) -> None:
        if self.available:
            log.warning("response cache: %s failed (%s: %s); bypassing it for %g s", what, type(exc).__name__, exc,
                        self.settings.retry_after_s)
        self._down_until = time.monotonic() + self.settings.retry_after_s

    # --- lookups and stores ---------------------------------------------------------------------
    async def lookup(self, keys: list[CacheKey], erased: Any = None) -> list[CachedAnswer | None]:
        """The entries of ``keys`` (one pipelined round trip), None where there is none to serve. While
        Redis is away every key bypasses (``unavailable``). ``erased(tenant, user, conversation, at)``:
        the erasure registry's test, applied to each entry's owner."""
        if not keys:
            return []
        if not self.available:
            return self._unavailable(keys)
        from redis.exceptions import RedisError

        try:
            pipe = self.client().pipeline(transaction=False)
            for key in keys:
                pipe.get(self.entry_key(key))
            pipe.smembers(self.retired_key)
            *values, retired = await pipe.execute()
        except (RedisError, OSError) as exc:
            self._failed("a lookup", exc)
            return self._unavailable(keys)
        retired = {v.decode() for v in retired}
        found: list[CachedAnswer | None] = []
        for key, value in zip(keys, values):
            entry = CachedAnswer.from_json(value) if value is not None else None
            if entry is not None and (entry.model in retired or (erased is not None and erased(
                    entry.tenant, entry.user_id, entry.conversation_id, entry.created_at))):
                self.hidden += 1
                entry = None
            (self.hits if entry is not None else self.misses)[key.tenant] += 1
            found.append(entry)
        return found

    def _unavailable(self, keys: list[CacheKey]) -> list[None]:
        for key in keys:
            self.bypasses[(key.tenant, UNAVAILABLE)] += 1
        return [None] * len(keys)

    async def store(self, entries: Iterable[tuple[CacheKey, CachedAnswer]]) -> int:
        """Write ``entries`` and index each under its owner; how many were written (0 while Redis is away:
        a lost store costs a future hit, nothing else)."""
        entries = list(entries)
        if not entries:
            return 0
        if not self.available:
            self.store_failures += len(entries)
            return 0
        from redis.exceptions import RedisError

        ttl = max(1, int(self.settings.ttl_s))
        pipe = self.client().pipeline(transaction=False)
        for key, entry in entries:
            name, index = self.entry_key(key), self.user_index(entry.tenant, entry.user_id)
            pipe.set(name, entry.to_json(), ex=ttl)
            pipe.sadd(index, name)
            pipe.expire(index, ttl)  # the index outlives none of its entries by more than a TTL
        try:
            await pipe.execute()
        except (RedisError, OSError) as exc:
            self._failed("a store", exc)
            self.store_failures += len(entries)
            return 0
        self.stored += len(entries)
        return len(entries)

    # --- invalidation ---------------------------------------------------------------------------
    async def erase_user(self, tenant: str, user_id: str) -> int:
        """Delete every entry ``user_id`` of ``tenant`` owns (a conversation's erasure takes all of the user's:
        an entry's context may hold turns recalled from any of their conversations); how many there were.
        Raises ``CacheUnavailableError`` when Redis does not answer (forget retries it)."""
        from redis.exceptions import RedisError

        index = self.user_index(tenant, user_id)
        try:
            names = await self.client().smembers(index)
            pipe = self.client().pipeline(transaction=False)
            for name in names:
                pipe.delete(name)
            pipe.delete(index)
            deleted = await pipe.execute()
        except (RedisError, OSError) as exc:
            raise CacheUnavailableError(f"response cache: erasing {tenant}/{user_id}'s entries: "
                                        f"{type(exc).__name__}: {exc}") from exc
        count = sum(deleted[:-1])
        self.erased_entries += count
        return count

    async def retire_version(self, version: str) -> None:
        """Stop serving the entries of ``version`` (they expire with their TTL or LRU)."""
        await self.client().sadd(self.retired_key, version)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


class CacheServer(CacheLayout):
    """A synchronous view of the cache's Redis, for threads and commands without an event loop: /metrics
    scrapes (``info``), ``chatpipe forget --verify`` (``entries_of``), ``chatpipe cache retire``."""

    def __init__(self, settings: CacheSettings) -> None:
        import redis

        super().__init__(settings)
        self.client = redis.Redis.from_url(settings.url, **self.client_options(for_asyncio=False))

    def info(self) -> dict[str, Any] | None:
        """Redis INFO (memory and stats sections merged); None when it does not answer."""
        from redis.exceptions import RedisError

        try:
            return {**self.client.info("memory"), **self.client.info("stats")}
        except (RedisError, OSError):
            return None

    def entries_of(self, tenant: str, user_id: str) -> list[CachedAnswer]:
        """Every entry ``user_id`` of ``tenant`` owns, found by reading the tenant's entries (SCAN), not the
        index: what a verification must see is what is there. Raises when Redis does not answer."""
        found = []
        for name in self.client.scan_iter(match=self.tenant_entries_pattern(tenant), count=1000):
            value = self.client.get(name)
            if value is not None and (entry := CachedAnswer.from_json(value)).user_id == user_id:
                found.append(entry)
        return found

    def retire(self, version: str) -> None:
        self.client.sadd(self.retired_key, version)

    def close(self) -> None:
        self.client.close()
