"""Settings of one gateway process (``chatpipe gateway``)."""

from __future__ import annotations

import re
import socket
from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.requests import DEFAULT_CONTEXT_TOKENS, MIN_CONTEXT_TOKENS
from transport.context_settings import SHARED_CONTEXT_ENV, with_shared_context

# The worker answers under inference.engine.settings.DEFAULT_MODEL_NAME; not imported, so the gateway
# does not depend on the engine package (tests/gateway/test_gateway_units.py keeps the two equal).
DEFAULT_MODEL = "smollm2-135m-instruct"


class GatewaySettings(BaseSettings):
    """From flags and ``CHATPIPE_GATEWAY_*`` variables (``CHATPIPE_GATEWAY_PORT``, ...)."""

    model_config = SettingsConfigDict(env_prefix="CHATPIPE_GATEWAY_", frozen=True, extra="ignore")

    host: str = Field("127.0.0.1", description="Address to listen on (loopback by default)")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port")
    keys_file: Path | None = Field(None, description="JSON file mapping API keys to tenants; required")
    gateway_id: str | None = Field(None, description="Names this instance's reply topic; default host-port")
    models: list[str] = Field(default_factory=lambda: [DEFAULT_MODEL], description="Model ids served")
    # A memory guard, not the queue's bound: a request is taken when its estimated first token fits its
    # deadline (gateway/admission.py); each one in flight costs the gateway about 50 KiB (MEMORY_PER_PENDING).
    max_pending: int = Field(4096, ge=1, description="Requests in flight in this gateway before new ones get 429 "
                             "(a memory guard: the estimated wait against the deadline decides first)")
    tenant_share: float = Field(0.5, gt=0, le=1, description="Most of max_pending one tenant may hold (at least 1 "
                                "request): a busy tenant gets 429 while the rest stays free for the others")
    # 15 heartbeats: a busy worker's reports can come late (its event loop held up on a loaded machine:
    # 10 s once answered a schema-constrained request 503 with the worker alive), and a worker that is
    # really gone costs only this long of requests admitted that it will not answer.
    worker_stale_s: float = Field(30.0, gt=0, description="A worker whose last report (chat.workers.status) is "
                                  "older is taken as gone; none of a model left: its requests get 503 at once")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="Largest request body; larger gets 413. "
                                "The default takes the largest prompt the request limits allow, JSON-escaped")
    context_tokens: int = Field(DEFAULT_CONTEXT_TOKENS, json_schema_extra=SHARED_CONTEXT_ENV, ge=MIN_CONTEXT_TOKENS,
                                description="The model's context (prompt + answer): CHATPIPE_CONTEXT_TOKENS, the "
                                            "size streams and the engine use; max_tokens must be below it")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when the request gives none")
    first_chunk_timeout_s: float = Field(300.0, gt=0, description="Give up (504) when no token came by then; "
                                         "also each PromptRequest's deadline (created_at + this)")
    flex_max_wait_s: float = Field(60.0, ge=0, description="service_tier flex (the batch class) is refused with 429 "
                                   "flex_capacity_unavailable when the estimated wait for a batch slot is longer: "
                                   "flex runs only where no interactive request waits, so the estimate is its least")
    chunk_timeout_s: float = Field(120.0, gt=0, description="Give up when the stream stalls this long")
    delivery_timeout_s: float = Field(5.0, gt=0, description="Answer 503 when the broker has not acknowledged "
                                      "a prompt by then (librdkafka's own default is 300 s)")
    reply_retention_ms: int = Field(60 * 60 * 1000, gt=0, description="Retention of the reply topic")
    reply_error_budget_s: float = Field(60.0, gt=0, description="How long the reply reader may fail (broker away, "
                                        "its topic gone) before the gateway exits 1 to be restarted")
    # Longer than clients keep an idle connection (httpx and the OpenAI SDK: 5 s, uvicorn's default too): with
    # equal timeouts a client reusing a connection the server is closing at that moment gets a reset
    # (tests/gateway/test_load.py saw one after a 5 s Retry-After). 75 s is nginx's default.
    keep_alive_s: float = Field(75.0, gt=0, description="How long an idle HTTP keep-alive connection stays open "
                                "(longer than clients keep theirs, so the client closes first)")
    # OpenAI's Files API (gateway/files.py): one store every replica shares, so any of them serves a file.
    files_uri: str = Field("", description="Where uploaded and batch files are kept: a folder or any fsspec URI "
                           "(s3://bucket/files, ...) every gateway replica shares; empty: a files folder beside the "
                           "keys file")
    max_file_bytes: int = Field(200 * 1024 * 1024, ge=1024, description="Largest file POST /v1/files takes "
                                "(OpenAI's batch input limit); larger gets 413")
    max_file_lines: int = Field(50_000, ge=1, description="Most requests (JSON lines) one batch input file may hold "
                                "(OpenAI's limit per batch)")
    # OpenAI's Batch API (gateway/batches.py, batch_runner.py): the lines run here as ordinary requests.
    batch_concurrency: int = Field(16, ge=1, description="Lines of the batches this gateway runs that are in "
                                   "flight at once (each an ordinary request at the batch priority class)")
    batch_window_s: float = Field(24 * 3600.0, gt=0, description="What completion_window \"24h\" gives a batch "
                                  "before it expires (the lines done by then are kept)")
    batch_progress_s: float = Field(1.0, gt=0, description="How often a running batch's counts are published")
    log_level: str = Field("info", description="debug, info, warning")

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        # context_tokens is the pipeline's one context size (schemas/requests.py), not a gateway setting
        return with_shared_context("context_tokens", init_settings, env_settings, dotenv_settings,
                                   file_secret_settings, settings_cls)

    @model_validator(mode="after")
    def _default_fits_the_context(self) -> "GatewaySettings":
        if self.default_max_tokens > self.context_tokens - 1:
            raise ValueError(f"default_max_tokens {self.default_max_tokens} does not fit the context of "
                             f"{self.context_tokens} tokens (CHATPIPE_CONTEXT_TOKENS); set "
                             f"CHATPIPE_GATEWAY_DEFAULT_MAX_TOKENS to at most {self.context_tokens - 1}")
        return self

    def files_store(self) -> str:
        """The file store's URI: ``files_uri``, else ``files`` beside the keys file (the local stack's state)."""
        if self.files_uri:
            return self.files_uri
        base = self.keys_file.resolve().parent if self.keys_file is not None else Path.cwd()
        return str(base / "files")

    def instance_id(self) -> str:
        """This gateway's id: given, or host-port (stable across restarts, so its reply topic is reused)."""
        raw = self.gateway_id or f"{socket.gethostname()}-{self.port}"
        return re.sub(r"[^A-Za-z0-9._-]", "-", raw)[:100]
