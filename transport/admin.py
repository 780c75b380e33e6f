"""Admin calls behind ``chatpipe topics`` and ``chatpipe status``: apply the catalog, describe topics.

``apply`` is idempotent: it creates missing topics, adds partitions where the catalog asks for
more (Kafka cannot remove partitions; fewer in the catalog is reported, not applied) and sets
the managed configs that differ. A second run on an unchanged catalog changes nothing.
Replication (factor and ``min.insync.replicas``) follows the cluster's size
(``schemas.topics.replication_for``); a replication factor cannot change in place, so a
mismatch is reported with the fix (partition reassignment), every run, not applied.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewPartitions,
    NewTopic,
    OffsetSpec,
)

from schemas.topics import CATALOG, TopicSpec, replication_for
from transport.errors import TopicExistsError, TransportError
from transport.failures import kafka_error
from transport.settings import KafkaSettings


@dataclass(frozen=True, slots=True)
class TopicChange:
    topic: str
    action: str  # "create" | "add-partitions" | "set-config" | "cannot-shrink" | "replication-mismatch"
    detail: str


@dataclass(frozen=True, slots=True)
class TopicInfo:
    name: str
    partitions: int
    end_offsets: list[int]  # per partition, in partition order

    @property
    def messages(self) -> int:
        return sum(self.end_offsets)


@dataclass(frozen=True, slots=True)
class GroupLag:
    group: str
    kind: str  # "consumer" | "classic" | "share" | ... (the broker's group type)
    state: str  # "STABLE", "EMPTY", "PREPARING_REBALANCING", ...
    members: int | None  # None: the broker would not describe it (e.g. a share group)
    lag: int | None  # committed offsets behind the end offsets, summed; None: not known (share group)


# librdkafka's own log lines (one per failed connect, hundreds while no broker answers) go to this
# logger: silent in a CLI, in the log file of a service that configures logging.
_client_log = logging.getLogger("transport.librdkafka")
_client_log.addHandler(logging.NullHandler())


# Errors of a topic whose metadata is still settling (just created): worth asking again shortly.
# UNKNOWN_LEADER_EPOCH ("Leader epoch is newer than broker epoch"): the broker asked has not yet
# applied the metadata the client already holds (seen in CI right after a topic's creation).
_SETTLING = (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
             KafkaError.UNKNOWN_LEADER_EPOCH)


# A group's coordinator still loading its offsets (a fresh broker) or moving (its broker died).
_COORDINATOR_MOVING = (KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
                       KafkaError.COORDINATOR_NOT_AVAILABLE)


def _setting(kind: ConfigResource.Type, name: str, config: dict[str, str]) -> ConfigResource:
    """An incremental alter-configs resource that sets every entry of ``config`` on ``name``."""
    return ConfigResource(kind, name, incremental_configs=[
        ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET) for k, v in config.items()])


class TopicAdmin:
    def __init__(self, settings: KafkaSettings, timeout_s: float = 30.0) -> None:
        self.settings = settings
        self.timeout_s = timeout_s
        self._admin = AdminClient({**settings.client_config(), "logger": _client_log})

    def check_reachable(self, timeout_s: float = 3.0) -> None:
        """TransportError at once when no bootstrap server accepts a TCP connection.

        Without it, a call on a broker that is not there retries for ``timeout_s`` (30 s) first.
        """
        for server in self.settings.bootstrap_servers.split(","):
            host, _, port = server.strip().rpartition(":")
            try:
                with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s):
                    return
            except (OSError, ValueError):
                continue
        raise TransportError(f"cannot reach Kafka at {self.settings.bootstrap_servers}: no bootstrap server "
                             "accepts connections (is the broker running? `chatpipe up --only kafka`)")

    def group_members(self, group_id: str) -> int:
        """Members of consumer group ``group_id`` now (0 when the group does not exist or is empty)."""
        futures = self._admin.describe_consumer_groups([group_id], request_timeout=self.timeout_s)
        try:
            return len(futures[group_id].result(timeout=self.timeout_s).members)
        except KafkaException as exc:
            error = kafka_error(exc)
            if error is not None and error.code() == KafkaError.GROUP_ID_NOT_FOUND:
                return 0
            raise TransportError(f"describe group {group_id}: {exc}") from exc
        except TimeoutError as exc:  # concurrent.futures': the broker did not answer in time
            raise TransportError(f"describe group {group_id}: no answer within {self.timeout_s} s") from exc

    def group_lags(self) -> list[GroupLag]:
        """Every group on the broker with its members and total lag (end offset - committed offset)."""
        listing = self._admin.list_consumer_groups(request_timeout=self.timeout_s).result(timeout=self.timeout_s)
        groups = sorted(listing.valid, key=lambda g: g.group_id)
        if not groups:
            return []
        described = self._admin.describe_consumer_groups([g.group_id for g in groups], request_timeout=self.timeout_s)
        lags = []
        for group in groups:
            kind = getattr(group.type, "name", str(group.type)).lower()
            state = getattr(group.state, "name", str(group.state))
            try:
                members = len(described[group.group_id].result(timeout=self.timeout_s).members)
            except (KafkaException, TimeoutError):
                members = None  # one group the broker cannot describe must not hide the others
            lags.append(GroupLag(group.group_id, kind, state, members, self._group_lag(group.group_id, kind)))
        return lags

    def _group_lag(self, group_id: str, kind: str) -> int | None:
        if kind == "share":
            return None  # a share group has no committed offsets to compare
        try:
            everything = [(t, p) for t, count in self.topic_partitions().items() for p in range(count)]
            committed = self.committed(group_id, everything)
        except (KafkaException, TransportError):
            return None
        partitions = [tp for tp, offset in committed.items() if offset >= 0]
        if not partitions:
            return 0
        end_of = self.offsets(partitions, OffsetSpec.latest())
        return sum(max(0, end_of[tp] - committed[tp]) for tp in partitions)

    def committed(self, group_id: str, partitions: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """The committed offset of ``group_id`` on each partition (negative: none).

        Asked through a consumer of that group (never joined), not the admin client's
        ListConsumerGroupOffsets: librdkafka 2.x dereferences a NULL consumer group in that call's
        answer to NOT_COORDINATOR (a coordinator still loading on a fresh broker, or moving after a
        broker died) and the process segfaults (confluentinc/librdkafka#5040, seen here in
        tests/streams/test_watchdog.py); a consumer retries the coordinator lookup instead.
        """
        consumer = Consumer({**self.settings.client_config(), "group.id": group_id, "enable.auto.commit": False,
                             "logger": _client_log})
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                try:
                    found = consumer.committed([TopicPartition(t, p) for t, p in partitions],
                                               timeout=max(1.0, deadline - time.monotonic()))
                    break
                except KafkaException as exc:
                    error = kafka_error(exc)
                    if (error is None or error.code() not in _COORDINATOR_MOVING) or time.monotonic() > deadline:
                        raise TransportError(f"committed offsets of group {group_id}: {exc}") from exc
                    time.sleep(0.25)  # the group's coordinator is loading or moving: ask again
        finally:
            consumer.close()
        return {(tp.topic, tp.partition): tp.offset for tp in found}

    def backlogs(self, group_id: str, partitions: list[tuple[str, int]]) -> dict[tuple[str, int], tuple[int, int]]:
        """(position, end offset) of each of ``partitions`` for ``group_id``: the position is the group's
        committed offset, or the partition's first offset where the group never committed (where an
        ``auto.offset.reset=earliest`` consumer starts). Records waiting = end - position."""
        if not partitions:
            return {}
        position = self.committed(group_id, partitions)
        ends = self.offsets(partitions, OffsetSpec.latest())
        never = [tp for tp in partitions if position.get(tp, -1) < 0]
        if never:
            position.update(self.offsets(never, OffsetSpec.earliest()))
        return {tp: (position[tp], ends[tp]) for tp in partitions}

    def offsets(self, partitions: list[tuple[str, int]], spec: OffsetSpec) -> dict[tuple[str, int], int]:
        """The ``spec`` offset (latest, earliest) of each of ``partitions``."""
        if not partitions:
            return {}
        found = self._wait(self._admin.list_offsets({TopicPartition(t, p): spec for t, p in partitions}),
                           "list offsets of")
        return {(tp.topic, tp.partition): info.offset for tp, info in found.items()}

    def _wait(self, futures: dict, what: str) -> dict:
        results = {}
        for key, future in futures.items():
            try:
                results[key] = future.result(timeout=self.timeout_s)
            except KafkaException as exc:
                error = kafka_error(exc)
                message = f"{what} {key}: {error.str() if error is not None else exc}"
                if error is not None and error.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                    raise TopicExistsError(message) from exc
                raise TransportError(message) from exc
            except Exception as exc:  # concurrent.futures.TimeoutError and friends
                raise TransportError(f"{what} {key}: {type(exc).__name__}: {exc} "
                                     f"(broker {self.settings.bootstrap_servers})") from exc
        return results

    def _metadata(self) -> Any:
        try:
            return self._admin.list_topics(timeout=self.timeout_s)
        except KafkaException as exc:
            raise TransportError(f"cannot reach Kafka at {self.settings.bootstrap_servers}: {exc}") from exc

    def topic_partitions(self) -> dict[str, int]:
        return {name: len(t.partitions) for name, t in self._metadata().topics.items() if not name.startswith("__")}

    def cluster_replication(self) -> tuple[int, dict[str, set[int]]]:
        """(brokers in the cluster, the replica counts of each topic's partitions).

        Brokers counted are the live ones plus every one holding a replica: with one node of
        three down the cluster still counts as three, and ``apply`` does not fall back to 1 copy.
        """
        metadata = self._metadata()
        brokers = set(metadata.brokers)
        counts: dict[str, set[int]] = {}
        for name, topic in metadata.topics.items():
            counts[name] = {len(p.replicas) for p in topic.partitions.values()}
            brokers.update(r for p in topic.partitions.values() for r in p.replicas)
        return len(brokers), counts

    def plan(self, catalog: tuple[TopicSpec, ...] = CATALOG) -> list[TopicChange]:
        """What ``apply`` would change, without changing anything."""
        return self._plan(catalog)[0]

    def _plan(self, catalog: tuple[TopicSpec, ...]) -> tuple[list[TopicChange], dict[str, tuple[int, dict[str, str]]]]:
        """The changes, and each topic's wanted (replication factor, managed config)."""
        existing = self.topic_partitions()
        brokers, replica_counts = self.cluster_replication()
        # An explicit CHATPIPE_REPLICATION_FACTOR (or flag) overrides the rule; its default does not.
        explicit_rf = self.settings.replication_factor if "replication_factor" in self.settings.model_fields_set else None
        changes: list[TopicChange] = []
        wanted: dict[str, tuple[int, dict[str, str]]] = {}
        present = [s for s in catalog if self.settings.topic(s.name) in existing]
        current_configs = self._configs([self.settings.topic(s.name) for s in present]) if present else {}
        for spec in catalog:
            name = self.settings.topic(spec.name)
            rf, min_isr = replication_for(spec, brokers, explicit_rf)
            if name not in existing:
                config = {**spec.config(), "min.insync.replicas": str(min_isr)}
                wanted[name] = (rf, config)
                changes.append(TopicChange(name, "create", f"{spec.partitions} partitions, replication factor {rf}, {config}"))
                continue
            have = existing[name]
            if spec.partitions > have:
                changes.append(TopicChange(name, "add-partitions", f"{have} -> {spec.partitions}"))
            elif spec.partitions < have:
                changes.append(TopicChange(name, "cannot-shrink", f"has {have}, catalog says {spec.partitions}"))
            have_rf = replica_counts.get(name) or {rf}
            if have_rf != {rf}:
                changes.append(TopicChange(name, "replication-mismatch", (
                    f"has {'/'.join(map(str, sorted(have_rf)))} replica(s) per partition, the catalog wants {rf}; "
                    "Kafka cannot change a replication factor in place: add or move replicas with a partition "
                    "reassignment (kafka-reassign-partitions.sh --generate/--execute, or "
                    "Admin.alterPartitionReassignments)")))
                # Until then min.insync.replicas must suit the copies the topic has, or every
                # acks=all write to it would fail.
                min_isr = min(min_isr, max(1, min(have_rf) - 1))
            config = {**spec.config(), "min.insync.replicas": str(min_isr)}
            wanted[name] = (rf, config)
            for key, want in config.items():
                if current_configs[name].get(key) != want:
                    changes.append(TopicChange(name, "set-config", f"{key}={want} (was {current_configs[name].get(key)})"))
        return changes, wanted

    def apply(self, catalog: tuple[TopicSpec, ...] = CATALOG) -> list[TopicChange]:
        """Make the broker match ``catalog``; returns the changes made (empty when in sync), and
        each replication mismatch, which it cannot fix in place (the detail says how)."""
        changes, wanted = self._plan(catalog)
        by_name = {self.settings.topic(s.name): s for s in catalog}
        creates = [NewTopic(c.topic, by_name[c.topic].partitions, wanted[c.topic][0], config=wanted[c.topic][1])
                   for c in changes if c.action == "create"]
        existed: set[str] = set()
        for new in creates:
            try:
                self._wait(self._admin.create_topics([new], operation_timeout=self.timeout_s), "create topic")
            except TopicExistsError:
                # Created meanwhile by another `apply`, or created already and not yet in the
                # metadata of the broker asked (a cluster's brokers learn of a topic one by one):
                # the end state is what we want, and this run did not change it.
                existed.add(new.topic)
        if creates:
            self._wait_listed([new.topic for new in creates])
        grows = [NewPartitions(c.topic, by_name[c.topic].partitions) for c in changes if c.action == "add-partitions"]
        if grows:
            self._wait(self._admin.create_partitions(grows), "add partitions to")
        config_topics = sorted({c.topic for c in changes if c.action == "set-config"})
        if config_topics:
            resources = [_setting(ConfigResource.Type.TOPIC, t, wanted[t][1]) for t in config_topics]
            self._wait(self._admin.incremental_alter_configs(resources), "set config of")
        return [c for c in changes if c.action != "cannot-shrink" and not (c.action == "create" and c.topic in existed)]

    def _wait_listed(self, names: list[str]) -> None:
        """Wait until the broker's metadata lists ``names``. A created topic reaches it a moment
        after CreateTopics returns (up to seconds on a loaded machine); until then a second
        ``apply`` would plan to create it again and a producer would get UNKNOWN_TOPIC."""
        deadline = time.monotonic() + self.timeout_s
        while not set(names) <= set(self.topic_partitions()) and time.monotonic() < deadline:
            time.sleep(0.1)

    def _while_settling(self, call):
        """``call()``, again while a new topic's metadata is still settling: brokers learn of a topic
        one by one, and its partitions get leaders a moment after it is listed (describing it right
        after its creation failed with NOT_LEADER_FOR_PARTITION in CI)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return call()
            except TransportError as exc:
                error = kafka_error(exc.__cause__) if isinstance(exc.__cause__, KafkaException) else None
                if error is None or error.code() not in _SETTLING or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def _configs(self, topics: list[str]) -> dict[str, dict[str, str]]:
        resources = [ConfigResource(ConfigResource.Type.TOPIC, t) for t in topics]
        results = self._while_settling(lambda: self._wait(self._admin.describe_configs(resources), "describe config of"))
        return {res.name: {k: e.value for k, e in entries.items()} for res, entries in results.items()}

    def create_topic(self, name: str, partitions: int = 1, config: dict[str, str] | None = None,
                     *, exist_ok: bool = False) -> None:
        """Create one topic outside the catalog (tests, tools); TopicExistsError if it is there."""
        new = NewTopic(name, partitions, self.settings.replication_factor, config=config or {})
        try:
            self._wait(self._admin.create_topics([new], operation_timeout=self.timeout_s), "create topic")
        except TopicExistsError:
            if not exist_ok:
                raise
        self._wait_listed([name])
        self.describe([name])  # returns once every partition has a leader: the topic is usable

    def set_share_group_config(self, group_id: str, config: dict[str, str]) -> None:
        """Set group-level configs of share group ``group_id`` (e.g. ``share.auto.offset.reset``).

        Idempotent; works before the group has any member. Without ``share.auto.offset.reset=
        earliest`` a new share group starts at the end of its topics and skips what is waiting.
        """
        resource = _setting(ConfigResource.Type.GROUP, group_id, config)
        self._wait(self._admin.incremental_alter_configs([resource]), "set config of share group")

    def set_topic_config(self, topic: str, config: dict[str, str]) -> None:
        """Set configs of ``topic`` (its real name), leaving the others as they are (an operator's
        change, or a fault drill's: ``message.timestamp.before.max.ms`` 0 refuses every write with
        INVALID_TIMESTAMP). ``apply`` sets the catalog's back."""
        resource = _setting(ConfigResource.Type.TOPIC, topic, config)
        self._wait(self._admin.incremental_alter_configs([resource]), "set config of")

    def describe(self, names: list[str] | None = None) -> list[TopicInfo]:
        """Topics with their partition count and end offsets (all non-internal topics by default)."""
        partitions = self.topic_partitions()
        names = sorted(partitions) if names is None else [n for n in names if n in partitions]
        if not names:
            return []
        request = [(n, p) for n in names for p in range(partitions[n])]
        offsets = self._while_settling(lambda: self.offsets(request, OffsetSpec.latest()))
        return [TopicInfo(n, partitions[n], [offsets.get((n, p), 0) for p in range(partitions[n])]) for n in names]
