"""The topic catalog: every Kafka topic chatpipe uses, as code.

``chatpipe topics apply`` creates missing topics and aligns the config of existing ones with
this table, idempotently. Names get the deployment's topic prefix (``Settings.topic_prefix``)
in front, so several pipelines can share one cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DAY_MS = 24 * 60 * 60 * 1000
#: chat.batches and chat.batch.results have as many partitions: a batch and its results share one.
BATCH_PARTITIONS = 3


@dataclass(frozen=True, slots=True)
class TopicSpec:
    name: str
    partitions: int
    key: str  # what the Kafka key holds; "conversation_id" keeps a conversation in order
    value: str  # record type of the value (Avro schema name)
    cleanup_policy: str = "delete"  # "delete" | "compact" | "compact,delete"
    retention_ms: int = 7 * DAY_MS  # -1 = keep forever
    doc: str = ""
    extra_config: dict[str, str] = field(default_factory=dict)
    # None: decided when the catalog is applied, from the cluster's size (``replication_for``).
    replication_factor: int | None = None
    min_insync_replicas: int | None = None  # copies an acks=all write needs before it is acknowledged
    # Who writes and who reads the topic, by component name ("gateway", "streams intake", "inference
    # worker", ...): the data-flow picture (schemas/flow.py, docs/img/data-flow.svg) is drawn from these.
    producers: tuple[str, ...] = ()
    consumers: tuple[str, ...] = ()

    def config(self) -> dict[str, str]:
        """Topic-level Kafka config this spec manages."""
        return {"cleanup.policy": self.cleanup_policy, "retention.ms": str(self.retention_ms), **self.extra_config}


CATALOG: tuple[TopicSpec, ...] = (
    TopicSpec("chat.prompts", 6, "conversation_id", "PromptRequest", retention_ms=1 * DAY_MS,
              doc="Prompts from applications and the gateway.",
              producers=("applications", "gateway"), consumers=("streams intake",)),
    TopicSpec("chat.inference.requests", 6, "conversation_id", "InferenceRequest", retention_ms=1 * DAY_MS,
              doc="Prompts with assembled context, consumed by inference workers.",
              producers=("streams intake",), consumers=("inference worker",)),
    TopicSpec("chat.inference.requests.batch", 6, "conversation_id", "InferenceRequest", retention_ms=1 * DAY_MS,
              doc="Requests of priority BATCH; workers take them only when no interactive request waits.",
              producers=("streams intake",), consumers=("inference worker",)),
    TopicSpec("chat.replies", 6, "request_id", "TokenChunk", retention_ms=60 * 60 * 1000,
              doc="Token chunks; each gateway instance owns one partition (its reply address).",
              producers=("inference worker", "streams intake", "streams embeddings"),
              consumers=("gateway", "applications")),
    TopicSpec("chat.responses", 6, "conversation_id", "Response", retention_ms=7 * DAY_MS,
              doc="Final answers, one per request.",
              producers=("inference worker", "streams intake"), consumers=("streams record",)),
    TopicSpec("chat.turns", 6, "conversation_id", "ConversationTurn", retention_ms=30 * DAY_MS,
              doc="Completed turns for archive, Spark jobs and analytics.",
              producers=("streams record",),
              consumers=("streams archive", "streams memory writer", "spark jobs", "analytics")),
    TopicSpec("chat.feedback", 6, "conversation_id", "Feedback", retention_ms=30 * DAY_MS,
              doc="Thumbs, regenerations and edits.",
              producers=("gateway", "applications"), consumers=("streams archive", "spark jobs", "analytics")),
    # Not compacted: every Deletion stays, in order. It is the source of truth of who was erased
    # (the dataset job and the streams worker read it from the start), and a compacted log keyed by
    # user alone let one tenant's deletion compact away another's (issue 19).
    TopicSpec("chat.deletions", 3, "tenant/user_id", "Deletion", retention_ms=-1,
              doc="Forget a user or a conversation (key: deletion_key); kept forever, never compacted.",
              producers=("gateway", "chatpipe forget"),
              consumers=("streams forget", "inference worker", "spark jobs", "chatpipe forget")),
    # The streams tier's forget agent puts one copy of each Deletion on every partition; partition p is
    # carried out by the streams worker owning the conversations of partition p (streams/forget.py).
    TopicSpec("chat.deletions.fanout", 6, "tenant/user_id", "Deletion", retention_ms=30 * DAY_MS,
              doc="One copy of each Deletion per conversation partition (streams forget -> its owner).",
              producers=("streams forget",), consumers=("streams forget",)),
    TopicSpec("chat.deletions.audit", 3, "user_id", "DeletionAudit", retention_ms=-1,
              doc="One record per Deletion carried out (streams: forget), kept forever.",
              producers=("streams forget", "inference worker"), consumers=("chatpipe forget",)),
    TopicSpec("chat.cancels", 6, "conversation_id", "Cancel", retention_ms=60 * 60 * 1000,
              doc="Stop a generation (client went away).",
              producers=("gateway",), consumers=("inference worker",)),
    TopicSpec("chat.workers.status", 1, "worker_id", "WorkerStatus", cleanup_policy="compact,delete",
              retention_ms=1 * DAY_MS, doc="Latest load report per inference worker.",
              producers=("inference worker",), consumers=("gateway", "streams intake", "analytics")),
    TopicSpec("chat.dlq", 3, "source topic", "DeadLetter", retention_ms=30 * DAY_MS,
              doc="Everything that could not be decoded or served, with the reason.",
              producers=("streams intake", "streams record", "streams forget", "inference worker"),
              consumers=("spark jobs", "analytics")),
    # The model registry: the latest record of each key is the version's state (schemas/models.py).
    TopicSpec("chat.models", 1, "name@version", "ModelVersion", cleanup_policy="compact", retention_ms=-1,
              doc="Fine-tuned model versions and their state (compacted: the latest record per version).",
              producers=("chatpipe train", "streams forget", "inference worker", "chatpipe model",
                         "streams versions"),
              consumers=("chatpipe model", "streams forget", "inference worker", "gateway", "streams intake",
                         "streams versions")),
    # Per-version answers and feedback, what the rollout rule decides on (streams/version_stats.py).
    TopicSpec("chat.models.stats", 1, "model", "VersionStats", cleanup_policy="compact", retention_ms=-1,
              doc="Per model version: turns, errors, ratings, regenerations, edits, TTFT, tokens/s (latest per key).",
              producers=("streams versions",), consumers=("streams versions", "analytics")),
    # OpenAI's Batch API (gateway/batches.py): a batch's state, and each line's answer stored once. A gateway
    # owning a partition of chat.batches (its runner's consumer group) runs that partition's batches and
    # reads their results from the same partition of chat.batch.results (``batch_partition``).
    TopicSpec("chat.batches", BATCH_PARTITIONS, "batch_id", "BatchJob", cleanup_policy="compact", retention_ms=-1,
              doc="Batches of the Batch API and their state (compacted: the latest record per batch).",
              producers=("gateway",), consumers=("gateway", "chatpipe batch")),
    TopicSpec("chat.batch.results", BATCH_PARTITIONS, "batch_id/custom_id", "BatchLineResult",
              cleanup_policy="compact", retention_ms=-1,
              doc="Each batch line's answer, once per line, in its batch's partition (tombstoned once the "
                  "batch's output file is written).",
              producers=("gateway",), consumers=("gateway",)),
    # OpenAI's Responses API (gateway/responses_routes.py): stored responses, which any gateway serves and
    # continues (previous_response_id); kept 30 days as OpenAI keeps them, deleted ones at once for readers.
    TopicSpec("chat.api.responses", 3, "response_id", "StoredResponse", cleanup_policy="compact,delete",
              retention_ms=30 * DAY_MS,
              doc="Stored responses of the Responses API (compacted: the latest record per response; 30 days).",
              producers=("gateway",), consumers=("gateway",)),
    # POST /v1/embeddings: the streams tier embeds with its memory model and answers on the asker's
    # reply address (an EmbeddingResult on chat.replies.<gateway id>; streams/embedding_requests.py).
    TopicSpec("chat.embeddings.requests", 6, "request_id", "EmbeddingRequest", retention_ms=60 * 60 * 1000,
              doc="Texts to embed (gateway -> streams); the result goes to the request's reply address.",
              producers=("gateway",), consumers=("streams embeddings",)),
)

BY_NAME: dict[str, TopicSpec] = {spec.name: spec for spec in CATALOG}

# The catalog's names for code: every topic a component uses comes from here, through
# ``KafkaSettings.topic()`` (which puts the deployment's prefix in front), never as a literal
# (tests/schemas/test_topic_names.py checks both: each name is in CATALOG, no literal elsewhere).
PROMPTS = "chat.prompts"
INFERENCE_REQUESTS = "chat.inference.requests"
INFERENCE_REQUESTS_BATCH = "chat.inference.requests.batch"
REPLIES = "chat.replies"  # a gateway's own reply topic is ``<prefix>chat.replies.<gateway id>``
RESPONSES = "chat.responses"
TURNS = "chat.turns"
FEEDBACK = "chat.feedback"
DELETIONS = "chat.deletions"
DELETIONS_AUDIT = "chat.deletions.audit"
DELETIONS_FANOUT = "chat.deletions.fanout"
CANCELS = "chat.cancels"
WORKERS_STATUS = "chat.workers.status"
DLQ = "chat.dlq"
EMBEDDING_REQUESTS = "chat.embeddings.requests"
MODELS = "chat.models"
MODEL_STATS = "chat.models.stats"
BATCHES = "chat.batches"
BATCH_RESULTS = "chat.batch.results"
STORED_RESPONSES = "chat.api.responses"


def inference_requests_topic(priority: str) -> str:
    """Catalog name of the topic an ``InferenceRequest`` of ``priority`` goes to.

    One topic per priority class, so a deep batch backlog never sits in front of an interactive
    request: workers drain ``chat.inference.requests`` first (docs/worker.md).
    """
    return INFERENCE_REQUESTS_BATCH if str(priority) == "BATCH" else INFERENCE_REQUESTS


def deletion_key(tenant: str, user_id: str) -> bytes:
    """Kafka key of a ``Deletion`` on ``chat.deletions``: ``<tenant>/<user_id>``, utf-8.

    The tenant is part of it, so one user's deletions stay in order on one partition and two
    tenants' users of the same id never share a key.
    """
    return f"{tenant}/{user_id}".encode()


def replication_for(spec: TopicSpec, brokers: int, replication_factor: int | None = None) -> tuple[int, int]:
    """(replication factor, min.insync.replicas) of ``spec`` on a cluster of ``brokers`` brokers.

    The spec's own values win, then ``replication_factor`` (a deployment's explicit setting), then
    the rule: 3 copies of which 2 must have each acknowledged write when the cluster has 3 brokers
    or more (one broker may die and nothing acknowledged is lost), else 1 and 1.
    """
    rf = spec.replication_factor or replication_factor or (3 if brokers >= 3 else 1)
    min_isr = spec.min_insync_replicas or (2 if rf >= 3 else 1)
    return rf, min(min_isr, rf)


def spec(name: str) -> TopicSpec:
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name!r} is not in the topic catalog; known: {sorted(BY_NAME)}") from None


def batch_partition(batch_id: str, partitions: int = BATCH_PARTITIONS) -> int:
    """The partition of ``chat.batches`` and ``chat.batch.results`` a batch's records go to (chosen here,
    not by the client's partitioner, so both topics agree whatever produces them)."""
    import zlib

    return zlib.crc32(batch_id.encode()) % partitions
