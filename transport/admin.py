"""Admin calls behind ``chatpipe topics`` and ``chatpipe status``: apply the catalog, describe topics.

``apply`` is idempotent: it creates missing topics, adds partitions where the catalog asks for
more (Kafka cannot remove partitions; fewer in the catalog is reported, not applied) and sets
the managed configs that differ. A second run on an unchanged catalog changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from confluent_kafka import KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewPartitions,
    NewTopic,
    OffsetSpec,
)

from schemas.topics import CATALOG, TopicSpec
from transport.errors import TopicExistsError, TransportError
from transport.settings import KafkaSettings


@dataclass(frozen=True, slots=True)
class TopicChange:
    topic: str
    action: str  # "create" | "add-partitions" | "set-config" | "cannot-shrink"
    detail: str


@dataclass(frozen=True, slots=True)
class TopicInfo:
    name: str
    partitions: int
    end_offsets: list[int]  # per partition, in partition order

    @property
    def messages(self) -> int:
        return sum(self.end_offsets)


class TopicAdmin:
    def __init__(self, settings: KafkaSettings, timeout_s: float = 30.0) -> None:
        self.settings = settings
        self.timeout_s = timeout_s
        self._admin = AdminClient(settings.client_config())

    def _wait(self, futures: dict, what: str) -> dict:
        results = {}
        for key, future in futures.items():
            try:
                results[key] = future.result(timeout=self.timeout_s)
            except KafkaException as exc:
                error = exc.args[0] if exc.args else None
                message = f"{what} {key}: {error.str() if error is not None else exc}"
                if error is not None and error.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                    raise TopicExistsError(message) from exc
                raise TransportError(message) from exc
            except Exception as exc:  # concurrent.futures.TimeoutError and friends
                raise TransportError(f"{what} {key}: {type(exc).__name__}: {exc} "
                                     f"(broker {self.settings.bootstrap_servers})") from exc
        return results

    def topic_partitions(self) -> dict[str, int]:
        try:
            metadata = self._admin.list_topics(timeout=self.timeout_s)
        except KafkaException as exc:
            raise TransportError(f"cannot reach Kafka at {self.settings.bootstrap_servers}: {exc}") from exc
        return {name: len(t.partitions) for name, t in metadata.topics.items() if not name.startswith("__")}

    def plan(self, catalog: tuple[TopicSpec, ...] = CATALOG) -> list[TopicChange]:
        """What ``apply`` would change, without changing anything."""
        existing = self.topic_partitions()
        changes: list[TopicChange] = []
        present = [s for s in catalog if self.settings.topic(s.name) in existing]
        current_configs = self._configs([self.settings.topic(s.name) for s in present]) if present else {}
        for spec in catalog:
            name = self.settings.topic(spec.name)
            if name not in existing:
                changes.append(TopicChange(name, "create", f"{spec.partitions} partitions, {spec.config()}"))
                continue
            have = existing[name]
            if spec.partitions > have:
                changes.append(TopicChange(name, "add-partitions", f"{have} -> {spec.partitions}"))
            elif spec.partitions < have:
                changes.append(TopicChange(name, "cannot-shrink", f"has {have}, catalog says {spec.partitions}"))
            for key, want in spec.config().items():
                if current_configs[name].get(key) != want:
                    changes.append(TopicChange(name, "set-config", f"{key}={want} (was {current_configs[name].get(key)})"))
        return changes

    def apply(self, catalog: tuple[TopicSpec, ...] = CATALOG) -> list[TopicChange]:
        """Make the broker match ``catalog``; returns the changes made (empty when in sync)."""
        changes = self.plan(catalog)
        by_name = {self.settings.topic(s.name): s for s in catalog}
        creates = [NewTopic(c.topic, by_name[c.topic].partitions, self.settings.replication_factor,
                            config=by_name[c.topic].config())
                   for c in changes if c.action == "create"]
        for new in creates:
            try:
                self._wait(self._admin.create_topics([new], operation_timeout=self.timeout_s), "create topic")
            except TopicExistsError:
                pass  # created meanwhile by another `apply`: the end state is what we want
        grows = [NewPartitions(c.topic, by_name[c.topic].partitions) for c in changes if c.action == "add-partitions"]
        if grows:
            self._wait(self._admin.create_partitions(grows), "add partitions to")
        config_topics = sorted({c.topic for c in changes if c.action == "set-config"})
        if config_topics:
            resources = [
                ConfigResource(ConfigResource.Type.TOPIC, t, incremental_configs=[
                    ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET)
                    for k, v in by_name[t].config().items()])
                for t in config_topics
            ]
            self._wait(self._admin.incremental_alter_configs(resources), "set config of")
        return [c for c in changes if c.action != "cannot-shrink"]

    def _configs(self, topics: list[str]) -> dict[str, dict[str, str]]:
        resources = [ConfigResource(ConfigResource.Type.TOPIC, t) for t in topics]
        results = self._wait(self._admin.describe_configs(resources), "describe config of")
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

    def set_share_group_config(self, group_id: str, config: dict[str, str]) -> None:
        """Set group-level configs of share group ``group_id`` (e.g. ``share.auto.offset.reset``).

        Idempotent; works before the group has any member. Without ``share.auto.offset.reset=
        earliest`` a new share group starts at the end of its topics and skips what is waiting.
        """
        resource = ConfigResource(ConfigResource.Type.GROUP, group_id, incremental_configs=[
            ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET) for k, v in config.items()])
        self._wait(self._admin.incremental_alter_configs([resource]), "set config of share group")

    def describe(self, names: list[str] | None = None) -> list[TopicInfo]:
        """Topics with their partition count and end offsets (all non-internal topics by default)."""
        partitions = self.topic_partitions()
        names = sorted(partitions) if names is None else [n for n in names if n in partitions]
        if not names:
            return []
        request = {TopicPartition(n, p): OffsetSpec.latest() for n in names for p in range(partitions[n])}
        offsets = self._wait(self._admin.list_offsets(request), "list offsets of")
        ends: dict[str, list[int]] = {n: [0] * partitions[n] for n in names}
        for tp, info in offsets.items():
            ends[tp.topic][tp.partition] = info.offset
        return [TopicInfo(n, partitions[n], ends[n]) for n in names]
