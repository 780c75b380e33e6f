"""The response cache's one settings object (env ``CHATPIPE_CACHE_*``): where Redis is and how long entries live.

The server's own limits (``maxmemory``, ``maxmemory-policy allkeys-lru``) are the server's: the local stack
starts it with them (``chatpipe up``, ``CHATPIPE_REDIS_MAXMEMORY``), a deployment sets them on its Redis or
Valkey. Not here: what is cached and when (``streams/response_cache.py``).
"""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class CacheSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CHATPIPE_CACHE_", frozen=True, extra="forbid")

    url: str | None = Field(None, description="Redis or Valkey URL of the response cache: redis://host:6379/0, "
                            "rediss://... for TLS, redis://user:password@host/0 with a password; empty = no "
                            "response cache (every prompt goes to a worker). `chatpipe up` passes its own Redis")
    password: SecretStr | None = Field(None, description="Password for Redis AUTH when it is not in the URL (from "
                                       "a Kubernetes Secret, say)")
    ttl_s: float = Field(24 * 3600, gt=0, description="How long an answer stays in the cache (Redis EXPIRE); "
                         "erasures and retired model versions remove or hide entries before that")
    timeout_s: float = Field(0.1, gt=0, description="Longest one Redis call may take (connect or answer) before "
                             "the cache is bypassed: a lookup is one round trip per intake batch")
    retry_after_s: float = Field(5.0, gt=0, description="After a failed call the cache is bypassed (counted as "
                                 "unavailable) for this long, then tried again")
    key_prefix: str = Field("chatpipe:", description="Prefix of every key the cache writes (several deployments "
                            "on one Redis use different ones)")
