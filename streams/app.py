"""The Faust app of ``chatpipe streams``: topics, the conversation table, the six agents.

Several workers of one app id split the partitions; every stream that reads or writes a
conversation's state (``chat.prompts``, ``chat.responses``, the table's changelog, the forget
fan-out, and ``chat.turns``/``chat.feedback`` for the archive) has 6 partitions and is keyed by
conversation id with Kafka's murmur2 rule, so Faust's assignor gives partition ``p`` of all of them
to one worker, and the table writes each key to its conversation's partition (``table.py``).

Memory's writes are not an agent's: the memory writer (``memory_writer.py``, a thread and a consumer
group of its own, ``<app id>.memory``) embeds and upserts the turns from ``chat.turns``, the durable
outbox, so a slow Qdrant delays memory and nothing else.

The erasure registry (``erasures.py``) is read from ``chat.deletions`` before the app is built
(and followed after) and shared by intake, record, forget, the memory writer and the archiver: a
record of an erased user that arrives late is neither recalled, remembered nor archived. The forget
agent fans each deletion out to every conversation partition; the partition's owner erases memory,
its table entries and its archive files through the same ``Archiver`` the archive agent writes with
(one lock) (``forget.py``). The workers' reports on ``chat.workers.status`` are followed too
(``fleet_follower.py``): intake's deadline estimate for prompts produced straight to ``chat.prompts``.

With a cache URL (``CacheSettings.url``) the response cache (``response_cache.py``) is looked up by
intake, written by record and erased by forget; its figures are on /metrics.

Built by a factory from explicit settings (no module-level app, nothing read from the
environment). Every topic carries raw bytes (``value_serializer="raw"``): the agents decode
with ``schemas.codec`` themselves so a bad record becomes a dead letter with its reason instead
of a Faust crash. Source topics come from the catalog (``chatpipe topics apply``); Faust
creates only its own internal topics (the table's changelog, its assignor topic) through its
admin client, since the broker refuses auto-created topics. Their names start with the app id,
which carries the deployment's topic prefix, and ``chatpipe status`` lists them.

Each agent's logic is a plain class (``streams/ports.py``: ``handle(messages, outbox)``); Faust runs
it through ``faust_runtime.agents.faust_agent``, with concurrency 1 (faust issue #606: concurrent
agents can commit an offset past an event still being processed), acking each batch once its effects
are durable, and ending the process unacked when an exception escapes (``faults.exit_without_ack``):
Faust's own handling would restart the agent on the next batch and commit past the failed one.
Everything that works around Faust is in ``streams/faust_runtime/`` (its ``__init__`` lists it).
"""

from __future__ import annotations

import logging

from schemas.topics import (
    DELETIONS,
    DELETIONS_AUDIT,
    DELETIONS_FANOUT,
    DLQ,
    EMBEDDING_REQUESTS,
    FEEDBACK,
    INFERENCE_REQUESTS,
    INFERENCE_REQUESTS_BATCH,
    MODELS,
    PROMPTS,
    RESPONSES,
    TURNS,
    spec,
)
from streams.archive import ArchiveAgent, Archiver
from streams.cache_answers import CachedAnswers
from streams.cache_settings import CacheSettings
from streams.dead_letters import DeadLetters
from streams.embedding_requests import EmbeddingRequests
from streams.erasures import ErasureFollower, ErasureRegistry
from streams.expiry import IdleExpiry
from streams.faults import EXIT_INFRASTRUCTURE, Retrier, exit_without_ack
from streams.faust_runtime import fetch_wait, offsets
from streams.faust_runtime.agents import faust_agent
from streams.faust_runtime.outbox import Outbox
from streams.faust_runtime.table import conversation_table
from streams.faust_runtime.watchdog import (
    ProgressWatchdog,
    StalledConsumerError,
    commit_acked_before_exit,
    faust_assignment,
    faust_restore,
)
from streams.fleet_follower import FleetFollower
from streams.forget import Forget, ForgetPartition
from streams.intake import Intake
from streams.model_taint import ModelTaint
from streams.memory_writer import MemoryWriter, memory_writer_group
from streams.metrics import AgentCounters, StreamsMetrics
from streams.record import Record
from streams.recorded import BrokerEndOffsets, RecordedOffsets
from streams.refusals import Refusals
from streams.response_cache import CacheServer, ResponseCache
from transport.reply_address import ReplyAddresses
from streams.services import StreamsServices
from streams.version_agent import VersionAgent
from streams.settings import StreamsSettings
from transport.acked_writer import AckedWriter
from transport.admin import TopicAdmin
from transport.errors import TransportError
from transport.fleet import Fleet
from transport.lag import GroupTopics
from transport.model_catalog import ModelCatalog
from transport import spans
from transport.logs import faust_logging_config
from transport.settings import KafkaSettings

log = logging.getLogger(__name__)

TABLE = "conversations"
#: Set when Faust creates the changelog: a forgotten conversation's old values (and then its
#: tombstone) must leave the compacted log within days, not whenever the cleaner's dirty ratio is
#: reached (the active segment is never compacted; max.compaction.lag.ms rolls and cleans it).
#: An existing changelog keeps its config: `kafka-configs --alter` it (docs/privacy.md).
CHANGELOG_ERASURE_CONFIG = {"max.compaction.lag.ms": str(24 * 3600 * 1000), "delete.retention.ms": str(24 * 3600 * 1000)}
FOLLOWER_READY_S = 30.0
RAW = dict(key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")


def app_id(kafka: KafkaSettings, settings: StreamsSettings) -> str:
    return f"{kafka.topic_prefix}{settings.app_id}"


def changelog_topic(kafka: KafkaSettings, settings: StreamsSettings) -> str:
    """The conversation table's changelog topic (Faust's naming: ``<app id>-<table>-changelog``)."""
    return f"{app_id(kafka, settings)}-{TABLE}-changelog"


class StreamsApp:
    """The app and its agents' objects (their counters are what tests and the bench read)."""

    def __init__(self, kafka: KafkaSettings, settings: StreamsSettings, services: StreamsServices,
                 erasures: ErasureRegistry | None = None, cache: CacheSettings | None = None) -> None:
        import faust
        from faust.types import TP

        offsets.install()  # partitions never committed are read again from their start after a rebalance
        fetch_wait.install(settings.fetch_max_wait_ms)  # not Faust's fixed 1500 ms (faust_runtime/fetch_wait.py)
        self.kafka, self.settings, self.services = kafka, settings, services
        # Before any agent runs: every deletion ever made (the log is kept forever), then the forget
        # agent adds the new ones.
        self.erasure_follower = None
        if erasures is None:
            erasures = ErasureRegistry()
            self.erasure_follower = _follow_erasures(kafka, services, erasures)
        self.erasures = erasures
        settings.state_dir.mkdir(parents=True, exist_ok=True)
        partitions = spec(PROMPTS).partitions
        self.app = app = faust.App(
            app_id(kafka, settings),
            broker=[f"kafka://{server.strip()}" for server in kafka.bootstrap_servers.split(",")],
            broker_client_id=kafka.client_id,
            # SASL/TLS of KafkaSettings (None: PLAINTEXT); Faust's producer, its consumers and the admin
            # requests creating the changelog all connect with them.
            broker_credentials=kafka.faust_broker_credentials(),
            store="memory://",  # restored from the changelog topic at start
            datadir=str(settings.state_dir),
            topic_partitions=partitions,  # the changelog's partition count
            topic_replication_factor=kafka.replication_factor,
            topic_allow_declare=True,
            consumer_auto_offset_reset="earliest",
            broker_commit_interval=settings.commit_interval_s,
            broker_session_timeout=settings.session_timeout_s,
            web_enabled=settings.web_port is not None,
            web_port=settings.web_port or 6066,
            autodiscover=False,
            producer_acks=-1,
            table_standby_replicas=settings.standby_replicas,
        )
        topic = lambda name: app.topic(kafka.topic(name), **RAW)
        # Every write of a key goes to the changelog partition of its conversation id (table.py), the
        # partition its prompts and responses arrive on: co-partitioned, so each of several workers
        # reads and writes only its own keys. Values are JSON dicts (streams/state.py).
        # No key/value type: Faust's default json serializer both ways, plain str keys and dict values
        # (a value_type of dict breaks Faust's changelog recovery, which expects a faust.Record).
        self.table = conversation_table(app, TABLE, partitions, extra_topic_configs=CHANGELOG_ERASURE_CONFIG)
        # One copy of each Deletion per conversation partition (forget.py): a catalog topic, so it exists
        # (with its replication) before any worker subscribes; Faust's own declaration raced the assignor.
        self.forget_topic = topic(DELETIONS_FANOUT)
        dlq = topic(DLQ)
        retrier = Retrier(settings.retry_budget_s, settings.retry_backoff_s, settings.retry_max_backoff_s)
        # Error chunks for refused prompts (streams/refusals.py says why not through Faust's producer).
        # A reply topic that does not exist fails within 10 s instead of librdkafka's 5 minutes.
        self.reply_producer = AckedWriter(kafka, codec=services.codec, linger_ms=0, tracer=services.tracer,
                                            extra_config={"message.timeout.ms": 10_000})
        admin = TopicAdmin(kafka, timeout_s=10.0)  # reply topics (intake, embeddings), backlogs (the watchdog)
        replies = ReplyAddresses.of(kafka, admin.topic_partitions, fresh_s=settings.reply_topics_cache_s)
        codec = services.codec
        intake_letters = DeadLetters(dlq, codec, "streams.intake")
        self.refusals = Refusals(intake_letters, retrier, self.reply_producer, replies)
        # Read-your-writes: intake waits for record to reach chat.responses' end before a conversation
        # with a pending request gets its next context (recorded.py).
        # From Faust's consumer: a partition's committed position (None when it does not know it), and
        # whether the partition is assigned to this worker now.
        responses = kafka.topic(RESPONSES)
        self.response_ends = BrokerEndOffsets(kafka, responses)
        self.recorded = RecordedOffsets(lambda p: offsets.committed_position(app.consumer, TP(responses, p)),
                                        self.response_ends, owned=lambda p: TP(responses, p) in app.consumer.assignment())
        self.metrics = StreamsMetrics()  # /metrics (streams/metrics.py), served by run_worker
        # The workers' reports, for intake's deadline estimate (fleet_follower.py; followed from run_worker).
        self.fleet = Fleet(settings.worker_stale_s)
        self.fleet_follower = FleetFollower(kafka, services.codec)
        # chat.models: which version answers each conversation (transport/model_catalog.py; followed from run_worker)
        self.models = ModelCatalog(kafka, services.codec)
        # per-version stats and the canaries' rollout rules (version_agent.py; started by run_worker)
        self.versions = VersionAgent(kafka, services.codec, self.models, self.metrics,
                                     interval_s=settings.version_stats_interval_s)
        # The response cache (response_cache.py): looked up by intake, written by record, erased by forget.
        self.cache = ResponseCache(cache) if cache is not None and cache.url else None
        self.cache_server = CacheServer(cache) if self.cache is not None else None  # /metrics: bytes, evictions
        self.cache_info = self.cache_server.info if self.cache_server is not None else None
        cached_answers = (CachedAnswers(self.reply_producer, replies, retrier, topic(RESPONSES), codec)
                          if self.cache is not None else None)
        self.intake = Intake(settings, services, self.table,
                             {name: topic(name) for name in (INFERENCE_REQUESTS, INFERENCE_REQUESTS_BATCH)},
                             intake_letters, self.refusals, retrier, recorded=self.recorded,
                             partitions=spec(RESPONSES).partitions, metrics=self.metrics, erasures=self.erasures,
                             fleet=self.fleet, cache=self.cache, cached_answers=cached_answers, models=self.models)
        # Memory's writes: from chat.turns, in a thread and a group of its own (memory_writer.py); started by
        # run_worker, so that building the app (tests, `chatpipe streams --check`) starts no consumer.
        self.memory_writer = MemoryWriter(kafka, settings, services, self.erasures,
                                          memory_writer_group(app_id(kafka, settings)))
        self.record = Record(settings, services, self.table, topic(TURNS),
                             DeadLetters(dlq, codec, "streams.record"), self.erasures,
                             recorded=self.recorded, cache=self.cache)
        archive_retrier = Retrier(settings.archive_retry_budget_s, settings.retry_backoff_s,
                                  settings.retry_max_backoff_s)
        self.archiver = Archiver(settings.archive_dir, codec, settings.archive_dedupe_window, self.erasures)
        forget_letters = DeadLetters(dlq, codec, "streams.forget")
        self.forget = Forget(services, self.forget_topic, partitions, forget_letters, retrier, archiver=self.archiver,
                             archive_retrier=archive_retrier, erasures=self.erasures, cache=self.cache,
                             audit_topic=topic(DELETIONS_AUDIT), models=ModelTaint(kafka), models_topic=topic(MODELS))
        self.forget_partition = ForgetPartition(
            services, self.table, partitions, topic(DELETIONS_AUDIT), forget_letters, retrier,
            archiver=self.archiver, archive_topics=[kafka.topic(TURNS), kafka.topic(FEEDBACK)],
            archive_retrier=archive_retrier, erasures=self.erasures)
        self.archive = ArchiveAgent(self.archiver, settings.archive_batch_size, settings.archive_flush_s,
                                    archive_retrier, tracer=services.tracer, group=settings.app_id)
        archive_source = app.topic(kafka.topic(TURNS), kafka.topic(FEEDBACK), **RAW)
        # POST /v1/embeddings: embedded with memory's own model, answered on the asker's reply address.
        self.embeddings = EmbeddingRequests(settings, services, DeadLetters(dlq, codec, "streams.embeddings"), retrier,
                                            self.reply_producer, replies)
        for name, channel, agent in (
            ("intake", topic(PROMPTS), self.intake),
            ("record", topic(RESPONSES), self.record),
            ("forget", topic(DELETIONS), self.forget),
            ("forget_partition", self.forget_topic, self.forget_partition),
            ("archive", archive_source, self.archive),
            ("embeddings", topic(EMBEDDING_REQUESTS), self.embeddings),
        ):
            app.agent(channel, name=f"streams.{name}", concurrency=1)(
                faust_agent(name, agent, lambda: Outbox(retrier, services.tracer)))
        # Records that wait on an assigned partition and reach no agent end the process (faust_runtime/watchdog.py).
        sources = {kafka.topic(t) for t in (PROMPTS, RESPONSES, DELETIONS, TURNS, FEEDBACK, DELETIONS_FANOUT,
                                            EMBEDDING_REQUESTS)}
        self.metrics.registry.register(AgentCounters(self))  # the agents' counters, read at every scrape
        self.lag_groups = [GroupTopics(app_id(kafka, settings), tuple(sorted(sources))),  # Faust's one group
                           GroupTopics(self.memory_writer.group_id, (kafka.topic(TURNS),))]  # memory's outbox
        self.watchdog = ProgressWatchdog(lambda tps: admin.backlogs(app_id(kafka, settings), tps), settings.stall_s,
                                         restore=faust_restore(app))

        # Idle conversations leave the table (expiry.py): each worker sweeps its own keys.
        self.expiry = IdleExpiry(self.table, lambda: services.state_lock, settings.conversation_idle_s)

        @app.timer(settings.idle_sweep_s)
        async def expire_idle_conversations() -> None:
            try:
                await self.expiry.sweep()
            except Exception as exc:  # noqa: BLE001 - a bug: exit unacked, the supervisor restarts
                exit_without_ack("streams.expiry", exc)

        @app.task
        async def watch_progress() -> None:
            try:
                await self.watchdog.run(faust_assignment(app, sources), settings.stall_check_s)
            except StalledConsumerError as exc:  # what was acked is committed; the stalled rest is read again
                await commit_acked_before_exit(app)
                exit_without_ack("streams.watchdog", exc)
            except Exception as exc:  # noqa: BLE001 - a bug: exit unacked, the supervisor restarts
                exit_without_ack("streams.watchdog", exc)


def _follow_erasures(kafka: KafkaSettings, services: StreamsServices, registry: ErasureRegistry) -> ErasureFollower:
    """Fill ``registry`` from ``chat.deletions`` and keep it current: the follower starts first, then
    the log is read to its end (erasures.py). Without the registry no agent may start (it would
    remember and archive erased users' records), so a broker that cannot be read ends the start with
    code 75, and so does a follower that dies later."""
    from confluent_kafka import KafkaException

    follower = ErasureFollower(kafka, services.codec)
    try:
        def take(deletion) -> None:
            registry.add(deletion)
            forget_recent = getattr(services.embedder, "forget_recent", None)
            if forget_recent is not None:  # intake's recent prompt vectors: no vector of an erased text is reused
                forget_recent()

        follower.start(None, take, on_failure=lambda exc: exit_without_ack("streams.erasures", exc))
        if not follower.ready.wait(FOLLOWER_READY_S):
            raise TimeoutError(f"no first fetch from chat.deletions within {FOLLOWER_READY_S:g} s")
        loaded = ErasureRegistry.load(kafka, services.codec)
    except (TimeoutError, KafkaException, TransportError) as exc:
        log.critical("cannot read chat.deletions to know the erased users: %s; exiting with code %d",
                     exc, EXIT_INFRASTRUCTURE)
        raise SystemExit(EXIT_INFRASTRUCTURE) from exc
    registry.merge(loaded)
    return follower


def run_worker(streams: StreamsApp) -> None:
    """Run until SIGTERM/SIGINT (Faust's worker handles both and stops the app cleanly)."""
    import faust

    worker = faust.Worker(streams.app, loglevel=streams.settings.log_level, redirect_stdouts=False,
                          logging_config=faust_logging_config("streams", streams.settings.log_level))
    spans.configure("streams")  # CHATPIPE_TRACING_*: where spans go (docs/observability.md)
    s = streams.settings
    streams.metrics.serve(s.metrics_port, streams.kafka, streams.lag_groups, s.lag_interval_s, host=s.metrics_host)
    streams.memory_writer.start(lambda exc: exit_without_ack("streams.memory_writer", exc))
    streams.fleet_follower.start(None, streams.fleet.update,
                                 on_failure=lambda exc: exit_without_ack("streams.fleet_follower", exc))
    streams.fleet.listening()
    from confluent_kafka import KafkaException

    try:  # the versions before the first prompt is taken: a request for one must find it
        streams.models.start(on_failure=lambda exc: exit_without_ack("streams.models", exc))
    except (KafkaException, TransportError) as exc:
        log.critical("cannot read chat.models to know the served model versions: %s; exiting with code %d",
                     exc, EXIT_INFRASTRUCTURE)
        raise SystemExit(EXIT_INFRASTRUCTURE) from exc
    try:
        streams.versions.start(lambda exc: exit_without_ack("streams.versions", exc))
    except (KafkaException, TransportError) as exc:
        log.critical("the version agent cannot start: %s; exiting with code %d", exc, EXIT_INFRASTRUCTURE)
        raise SystemExit(EXIT_INFRASTRUCTURE) from exc
    try:
        worker.execute_from_commandline()
    finally:
        streams.versions.close()
        streams.models.close()
        streams.fleet_follower.close()
        streams.memory_writer.close()
        streams.metrics.close()
        spans.shutdown()
        streams.reply_producer.close(timeout_s=10)
        streams.response_ends.close()
        if streams.cache_server is not None:
            streams.cache_server.close()
        if streams.erasure_follower is not None:
            streams.erasure_follower.close()
        streams.services.close()
        log.info("streams worker stopped")
