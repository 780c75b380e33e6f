"""Typed Python records, one per Avro schema in ``avro/`` (latest version of each).

These dataclasses are what the rest of chatpipe passes around; the codec turns them into
Avro single-object-encoded bytes and back. Field names and order mirror the latest ``.avsc``
file of the same name (``tests/schemas/test_codec.py::test_records_match_latest_schemas`` keeps the two in step).

Timestamps are ``int`` milliseconds since the Unix epoch (Avro ``timestamp-millis``); the
codec keeps them as integers so a record decodes to exactly what was encoded.

This module does no I/O and knows nothing about Kafka.
"""

from __future__ import annotations

import builtins
import time
import uuid
from dataclasses import dataclass, field
from enum import StrEnum


def new_id() -> str:
    """A fresh request/event id (UUID4, hex)."""
    return uuid.uuid4().hex


def now_ms() -> int:
    """Wall-clock time in epoch milliseconds, the unit of every timestamp field."""
    return time.time_ns() // 1_000_000


class Priority(StrEnum):
    INTERACTIVE = "INTERACTIVE"
    BATCH = "BATCH"


class FinishReason(StrEnum):
    STOP = "STOP"
    LENGTH = "LENGTH"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    ERROR = "ERROR"
    OVERLOADED = "OVERLOADED"


class FeedbackKind(StrEnum):
    THUMBS_UP = "THUMBS_UP"
    THUMBS_DOWN = "THUMBS_DOWN"
    REGENERATE = "REGENERATE"
    EDIT = "EDIT"


class MemoryScope(StrEnum):
    """What a prompt may recall (PromptRequest v4). USER: every conversation of (tenant, user_id),
    for an identified end user; CONVERSATION: only its own conversation's turns."""
    USER = "USER"
    CONVERSATION = "CONVERSATION"


class DeletionScope(StrEnum):
    USER = "USER"
    CONVERSATION = "CONVERSATION"


class ModelState(StrEnum):
    """Where a model version stands (ModelVersion): trained and not served yet, served to a share of
    traffic, served, no longer served, failed its checks, or trained on data of a user since erased."""
    CANDIDATE = "CANDIDATE"
    CANARY = "CANARY"
    LIVE = "LIVE"
    RETIRED = "RETIRED"
    FAILED = "FAILED"
    TAINTED = "TAINTED"


class BatchStatus(StrEnum):
    """Where a batch stands (BatchJob): OpenAI's Batch API statuses, in capitals."""
    VALIDATING = "VALIDATING"
    FAILED = "FAILED"
    IN_PROGRESS = "IN_PROGRESS"
    FINALIZING = "FINALIZING"
    COMPLETED = "COMPLETED"
    EXPIRED = "EXPIRED"
    CANCELLING = "CANCELLING"
    CANCELLED = "CANCELLED"


class WorkerState(StrEnum):
    STARTING = "STARTING"
    SERVING = "SERVING"
    DRAINING = "DRAINING"
    STOPPED = "STOPPED"
    FAILED = "FAILED"  # v2 of WorkerStatus: an infrastructure fault or a dead thread; the process exits


@dataclass(slots=True)
class ChatMessage:
    role: str  # system | user | assistant
    content: str


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.7  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    # PromptRequest v5 / InferenceRequest v3 (OpenAI's meanings; rules in schemas/requests.py):
    presence_penalty: float = 0.0  # [-2, 2], once per token already in the answer
    frequency_penalty: float = 0.0  # [-2, 2], times the token's count in the answer
    logprobs: bool = False  # each generated token's logprob on the chunks (TokenChunk v3)
    top_logprobs: int = 0  # 0-20 most likely alternatives per position, only with logprobs
    n: int = 1  # 1-8 choices, each streamed with its choice_index
    # OpenAI's response_format object as JSON text (json_object / json_schema); None = free text
    # ({"type": "text"} is stored as None). schemas.requests.response_format_text writes it.
    response_format: str | None = None


@dataclass(slots=True)
class Header:
    key: str
    value: bytes | None


@dataclass(slots=True, kw_only=True)
class PromptRequest:
    request_id: str = field(default_factory=new_id)
    conversation_id: str
    user_id: str
    tenant: str
    created_at: int = field(default_factory=now_ms)
    model: str
    messages: list[ChatMessage]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = True
    reply_to: str | None = None
    reply_partition: int | None = None
    priority: Priority = Priority.INTERACTIVE
    # v3: when the asker stops waiting (epoch ms); None = no deadline. A tier that takes the
    # request after it answers "expired" instead of serving it.
    deadline_at: int | None = None
    # v4: USER = memory across every conversation of (tenant, user_id): the producer vouches that
    # user_id is an identified end user (versions before v4 read as USER). CONVERSATION = recall
    # from this conversation only; the gateway sets it when a request names no identified user.
    memory_scope: MemoryScope = MemoryScope.USER
    # v5 (POST /v1/completions): a raw text prompt, tokenized as it is: no chat template, no system
    # prompt, no memory recall, not remembered; ``messages`` is then empty. None: a chat request.
    raw_prompt: str | None = None
    # v6: the sender's weight in the fair share when tenants compete (the keys file's ``weight``):
    # the worker's engine orders tenants by tokens served / weight (inference/engine/fair_queue.py).
    share_weight: float = 1.0
    # v7: False opts this request out of streams' response cache (streams/response_cache.py): the gateway's
    # X-Chatpipe-Cache: off, extra_body {"cache": false}, or its key's default in the keys file.
    response_cache: bool = True
    # v8: False: the prompt neither recalls memory nor is remembered (a Batch API line that names no
    # conversation; the gateway's X-Chatpipe-Memory: off). Writers before v8 read as True.
    memory: bool = True
    schema_version: int = 8  # v8: memory; v7: response_cache; v6: share_weight; v5: the sampling fields of issue 23


@dataclass(slots=True, kw_only=True)
class InferenceRequest:
    request_id: str
    conversation_id: str
    user_id: str
    tenant: str
    created_at: int
    enqueued_at: int = field(default_factory=now_ms)
    model: str
    messages: list[ChatMessage]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: Priority = Priority.INTERACTIVE
    reply_to: str | None = None
    reply_partition: int | None = None
    context_tokens: int = 0
    recalled_turn_ids: list[str] = field(default_factory=list)
    deadline_at: int | None = None  # v2: carried over from the PromptRequest
    # v3: PromptRequest v5's raw_prompt, carried over: the worker tokenizes it as it is (no chat
    # template) and ``messages`` is empty. None: the chat template over ``messages``.
    raw_prompt: str | None = None
    share_weight: float = 1.0  # v4: PromptRequest v6's, carried over
    # v5: recall did not answer in time (Qdrant slow or away): the context has the recent turns only
    memory_degraded: bool = False
    schema_version: int = 5  # v5: memory_degraded; v4: share_weight; v3: the sampling fields of PromptRequest v5


@dataclass(slots=True)
class TopLogprob:
    """One of the most likely tokens at a position (TokenChunk v3)."""
    token: str  # the token's text (a partial UTF-8 character shows as U+FFFD: see bytes)
    logprob: float
    # the token's own UTF-8 bytes, possibly part of a character (builtins.: the field shadows the name)
    bytes: builtins.bytes


@dataclass(slots=True)
class TokenLogprob:
    """The chosen token at one position and, with top_logprobs, its most likely alternatives."""
    token: str
    logprob: float  # log_softmax of the model's raw logits (before penalties, temperature, masks)
    bytes: builtins.bytes
    top: list[TopLogprob] = field(default_factory=list)


@dataclass(slots=True, kw_only=True)
class TokenChunk:
    request_id: str
    conversation_id: str
    index: int
    text: str
    token_ids: list[int] = field(default_factory=list)
    is_final: bool = False
    worker_id: str
    created_at: int = field(default_factory=now_ms)
    # Set on the final chunk only (v2): how the request ended, so a client that reads nothing but
    # its reply address can report usage and errors.
    finish_reason: FinishReason | None = None
    tokens_in: int | None = None
    tokens_out: int | None = None
    error_code: str | None = None  # context_length_exceeded | invalid_request | cancelled | internal_error
    error: str | None = None
    # v3: which of the request's n choices (index counts 0, 1, 2, ... per choice), and with
    # sampling.logprobs one TokenLogprob per token of token_ids, in order (None without).
    choice_index: int = 0
    logprobs: list[TokenLogprob] | None = None
    # v4, final chunk: prompt tokens taken from the engine's prefix cache (OpenAI's
    # usage.prompt_tokens_details.cached_tokens; every prompt token on a response-cache hit); and whether
    # the answer came from streams' response cache (no worker ran).
    cached_tokens: int | None = None
    response_cached: bool = False
    schema_version: int = 4


@dataclass(slots=True, kw_only=True)
class Response:
    request_id: str
    conversation_id: str
    user_id: str
    tenant: str
    text: str
    model: str
    worker_id: str
    tokens_in: int
    tokens_out: int
    queue_ms: float
    ttft_ms: float
    total_ms: float
    finish_reason: FinishReason
    error: str | None = None
    created_at: int
    completed_at: int = field(default_factory=now_ms)
    # v2: a request with n > 1 is answered by one Response per choice; streams records choice 0's.
    choice_index: int = 0
    # v3: prompt tokens the engine's prefix cache held (every one on a response-cache hit), and whether the
    # answer came from streams' response cache (worker_id "streams.response-cache", no worker ran).
    cached_tokens: int = 0
    response_cached: bool = False
    schema_version: int = 3


@dataclass(slots=True, kw_only=True)
class Cancel:
    request_id: str
    conversation_id: str
    reason: str = "client_disconnected"
    created_at: int = field(default_factory=now_ms)
    schema_version: int = 1


@dataclass(slots=True, kw_only=True)
class ConversationTurn:
    event_id: str = field(default_factory=new_id)
    conversation_id: str
    user_id: str
    tenant: str
    request_id: str
    # v3: the W3C trace id (32 hex) of the request's trace, so a turn, its archive row and the
    # dataset rows built from it lead to the request's spans (docs/observability.md "Lineage").
    # None for turns written before v3, or recorded without a trace.
    trace_id: str | None = None
    turn_index: int
    system_prompt: str | None = None
    prompt: str
    answer: str
    model: str
    worker_id: str
    tokens_in: int
    tokens_out: int
    queue_ms: float
    ttft_ms: float = 0.0
    total_ms: float
    finish_reason: FinishReason
    created_at: int
    completed_at: int
    # v4: whether memory keeps the turn (streams' memory writer upserts it from chat.turns), and whether its
    # prompt was answered without recalled memory (recall late: InferenceRequest v5 memory_degraded).
    remembered: bool = False
    memory_degraded: bool = False
    cached_tokens: int = 0  # v5: the Response's (prefix-cache hits; every prompt token on a response-cache hit)
    response_cached: bool = False  # v5: answered from streams' response cache
    schema_version: int = 5


@dataclass(slots=True, kw_only=True)
class Feedback:
    event_id: str = field(default_factory=new_id)
    conversation_id: str
    user_id: str
    tenant: str
    request_id: str
    kind: FeedbackKind
    edited_text: str | None = None
    comment: str | None = None
    created_at: int = field(default_factory=now_ms)
    schema_version: int = 1


@dataclass(slots=True, kw_only=True)
class Deletion:
    event_id: str = field(default_factory=new_id)
    scope: DeletionScope
    user_id: str
    tenant: str
    conversation_id: str | None = None
    reason: str = "user_request"
    created_at: int = field(default_factory=now_ms)
    schema_version: int = 1


@dataclass(slots=True, kw_only=True)
class WorkerStatus:
    worker_id: str
    model: str
    state: WorkerState
    running: int
    waiting: int
    kv_cache_used_tokens: int
    kv_cache_total_tokens: int
    tokens_per_s: float
    # v3: what an estimate of a new request's wait needs (transport/fleet.py): the batch, the work queued
    # and running in tokens (budgets: prompt + max_tokens), the throughput measured while saturated.
    max_running: int = 0
    queued_prompt_tokens: int = 0
    queued_output_tokens: int = 0
    running_output_tokens: int = 0
    decode_tokens_per_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    # v4: the fine-tuned versions (name@version) it serves besides its base model (issue 42)
    model_versions: list[str] = field(default_factory=list)
    created_at: int = field(default_factory=now_ms)
    schema_version: int = 4  # v2: WorkerState FAILED; v3: the load in tokens and the saturated throughput


@dataclass(slots=True, kw_only=True)
class DeadLetter:
    event_id: str = field(default_factory=new_id)
    source_topic: str | None = None
    source_partition: int | None = None
    source_offset: int | None = None
    key: bytes | None = None
    value: bytes | None = None
    headers: list[Header] = field(default_factory=list)
    error_type: str
    error_message: str
    component: str
    created_at: int = field(default_factory=now_ms)
    schema_version: int = 1


@dataclass(slots=True, kw_only=True)
class DeletionAudit:
    event_id: str = field(default_factory=new_id)
    deletion_event_id: str  # the Deletion carried out
    scope: DeletionScope
    user_id: str
    tenant: str
    conversation_id: str | None = None
    memory_points_deleted: int
    conversations_cleared: int
    component: str
    requested_at: int  # Deletion.created_at
    created_at: int = field(default_factory=now_ms)
    schema_version: int = 1


@dataclass(slots=True, kw_only=True)
class EmbeddingRequest:
    """Texts to embed with the streams tier's memory model (POST /v1/embeddings; streams/embedding_requests.py)."""
    request_id: str = field(default_factory=new_id)
    tenant: str
    user_id: str
    created_at: int = field(default_factory=now_ms)
    model: str
    inputs: list[str]
    dimensions: int | None = None  # None: the model's own; any other is refused
    reply_to: str
    reply_partition: int | None = None
    deadline_at: int | None = None
    schema_version: int = 1


@dataclass(slots=True, kw_only=True)
class EmbeddingResult:
    """An EmbeddingRequest's answer on its reply address: ``count`` x ``dimensions`` little-endian
    float32 in ``vectors`` (row-major), or ``error_code`` with the reason."""
    request_id: str
    model: str
    dimensions: int = 0
    count: int = 0
    vectors: bytes = b""
    tokens_in: int = 0
    worker_id: str
    error_code: str | None = None
    error: str | None = None
    error_param: str | None = None  # OpenAI's param: input[2], dimensions, model
    created_at: int = field(default_factory=now_ms)
    schema_version: int = 1


@dataclass(slots=True, kw_only=True)
class ModelVersion:
    """One fine-tuned version of a model (chat.models, key ``model_key(name, version)``); a state change is
    the same record again with a new ``state`` and ``updated_at`` (schemas/models.py has the artifact layout)."""
    event_id: str = field(default_factory=new_id)
    name: str
    version: int
    base_model: str
    base_model_sha256: str
    adapter_uri: str
    adapter_sha256: str
    card_uri: str
    lineage_uri: str
    dataset_uri: str
    dataset_manifest_id: str
    tenant: str | None = None  # None: trained on data declared shared
    data_tenants: list[str] = field(default_factory=list)
    training_rows: int
    hyperparameters: dict[str, str] = field(default_factory=dict)
    train_loss: float | None = None
    eval_loss: float | None = None
    eval_loss_before: float | None = None
    eval_results: dict[str, float] = field(default_factory=dict)
    state: ModelState = ModelState.CANDIDATE
    state_reason: str | None = None
    canary_share: float = 0.0  # v2: while CANARY, the share of new conversations it answers (transport/model_catalog.py)
    # v2: the rollout rule declared with the canary (streams/version_stats.py); rule_min_rated 0 = none
    rule_min_rated: int = 0
    rule_max_drop: float = 0.05
    rule_confidence: float = 0.95
    created_at: int = field(default_factory=now_ms)
    updated_at: int = field(default_factory=now_ms)
    schema_version: int = 2


@dataclass(slots=True, kw_only=True)
class VersionStats:
    """Answers and feedback of one model version (chat.models.stats, key ``model``): cumulative since
    ``since``; rates are the reader's (thumbs_up / rated, errors / turns, tokens_out / decode_ms_sum)."""
    model: str
    turns: int = 0
    errors: int = 0
    rated: int = 0
    thumbs_up: int = 0
    thumbs_down: int = 0
    regenerations: int = 0
    edits: int = 0
    ttft_ms_sum: float = 0.0
    tokens_out: int = 0
    decode_ms_sum: float = 0.0
    since: int = 0
    updated_at: int = field(default_factory=now_ms)
    schema_version: int = 1


@dataclass(slots=True, kw_only=True)
class BatchError:
    """Why a batch failed validation (OpenAI's ``errors.data[]``): one per bad line."""
    code: str
    message: str
    param: str | None = None
    line: int | None = None  # 1-based line of the input file


@dataclass(slots=True, kw_only=True)
class BatchJob:
    """One batch of the Batch API (chat.batches, compacted, key ``batch_id``): every change is the whole
    record again; readers merge what they read (transport/batch_book.py ``merge``: the times of the
    steps a batch took are kept once set, so a cancel and a progress report written at once both hold).
    Times of the steps are OpenAI's, epoch seconds; ``updated_at`` milliseconds."""
    batch_id: str
    tenant: str
    key_fingerprint: str  # SHA-256 of the API key that made it: its lines run as that key, while it is valid
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] = field(default_factory=dict)
    status: BatchStatus = BatchStatus.VALIDATING
    errors: list[BatchError] = field(default_factory=list)
    total: int = 0
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int  # seconds
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    updated_at: int = field(default_factory=now_ms)
    schema_version: int = 1


@dataclass(slots=True, kw_only=True)
class BatchLineResult:
    """The answer to one line of a batch (chat.batch.results, compacted, key ``batch_id/custom_id``, in
    the partition of its batch): stored once per line, so a batch resumed anywhere runs only the lines
    without one; ``body`` is the endpoint's JSON answer (or its error body) as the client gets it."""
    batch_id: str
    custom_id: str
    line: int  # 1-based line of the input file
    status_code: int
    request_id: str = ""
    body: str  # JSON
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    created_at: int = field(default_factory=now_ms)
    schema_version: int = 1


@dataclass(slots=True, kw_only=True)
class StoredResponse:
    """A response of the Responses API kept for ``GET`` and for the follow-ups that name it
    (chat.api.responses, compacted, key ``response_id``): every change is the whole record again.
    ``messages`` is what its input added to the chain (chat messages, JSON), ``body`` the response
    object as the client gets it (JSON); ``deleted``: gone for every reader (DELETE, or an erasure)."""
    response_id: str
    tenant: str
    user_id: str
    conversation_id: str
    previous_response_id: str | None = None
    status: str
    messages: str  # JSON
    body: str  # JSON
    deleted: bool = False
    created_at: int = field(default_factory=now_ms)
    updated_at: int = field(default_factory=now_ms)
    schema_version: int = 1


#: Every top-level record type, by its Avro record name.
RECORD_TYPES: dict[str, type] = {cls.__name__: cls for cls in (
    PromptRequest, InferenceRequest, TokenChunk, Response, Cancel, ConversationTurn, Feedback, Deletion, WorkerStatus,
    DeadLetter, DeletionAudit, EmbeddingRequest, EmbeddingResult, ModelVersion, VersionStats, BatchJob, BatchLineResult,
    StoredResponse)}
