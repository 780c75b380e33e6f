"""A share group's start offset and lag per partition, asked of the broker (DescribeShareGroupOffsets).

confluent-kafka 2.16 (librdkafka 2.16) has no admin call for share groups: no
``list_share_group_offsets``, no ``describe_share_groups`` (the Java admin client's
``listShareGroupOffsets``, behind ``kafka-share-groups.sh --describe --offsets``). So this module
sends that one request itself, over a plain socket, in Kafka's wire format: ApiVersions (which
versions the broker speaks), FindCoordinator (the group's coordinator), DescribeShareGroupOffsets
(API 90; v1 has KIP-1226's ``Lag``, v0 the start offset only). Every record below a partition's
share-partition start offset (SPSO) is acknowledged or archived; the broker's lag is the records
from there to the end not yet acknowledged.

PLAINTEXT and SSL listeners only: SASL would need its handshake here as well. On a SASL listener
``ShareOffsetsUnsupported`` is raised and the caller reports the lag as not known. Replace the
whole module with the client's call once confluent-kafka has one.
"""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass
from io import BytesIO
from typing import Iterable

from aiokafka.protocol.types import Array, CompactArray, CompactString, Int8, Int16, Int32, Int64, Schema, TaggedFields

from transport.errors import TransportError
from transport.settings import KafkaSettings

API_VERSIONS, FIND_COORDINATOR, DESCRIBE_SHARE_GROUP_OFFSETS = 18, 10, 90
_RETRIABLE = {14, 15, 16}  # COORDINATOR_LOAD_IN_PROGRESS, COORDINATOR_NOT_AVAILABLE, NOT_COORDINATOR
GROUP_ID_NOT_FOUND = 69
_CLIENT_ID = b"chatpipe-lag"


class _Retry(Exception):
    """The coordinator is loading, not there yet (a fresh broker) or moved: find it again."""


class ShareOffsetsUnsupported(TransportError):
    """This broker connection (SASL) or broker (no API 90) cannot be asked for share group offsets here."""


@dataclass(frozen=True, slots=True)
class SharePartitionOffset:
    topic: str
    partition: int
    start_offset: int  # -1: the group has no state on the partition yet
    lag: int | None  # the broker's count (v1); None: not given (v0, or -1 from the broker)


# --- the wire format: Kafka's message definitions (its common/message/*.json), in aiokafka's protocol types ---

_STR = CompactString("utf-8")
_TAGS = ("tags", TaggedFields)  # a flexible version's tagged fields (none sent, those received skipped)
_UUID = Schema(("most", Int64), ("least", Int64))
_API_VERSIONS_ANSWER = Schema(("error", Int16), ("apis", Array(("key", Int16), ("min", Int16), ("max", Int16))))
_FIND_COORDINATOR_ASK = Schema(("key_type", Int8), ("keys", CompactArray(_STR)), _TAGS)
_FIND_COORDINATOR_ANSWER = Schema(("throttle", Int32), ("coordinators", CompactArray(
    ("key", _STR), ("node_id", Int32), ("host", _STR), ("port", Int32), ("error", Int16), ("message", _STR), _TAGS)))
_DESCRIBE_ASK = Schema(("groups", CompactArray(("group", _STR), ("topics", CompactArray(
    ("topic", _STR), ("partitions", CompactArray(Int32)), _TAGS)), _TAGS)), _TAGS)


def _describe_answer(version: int) -> Schema:
    """DescribeShareGroupOffsets' answer; v1 adds each partition's ``lag`` (KIP-1226)."""
    lag = [("lag", Int64)] if version >= 1 else []
    partitions = CompactArray(("partition", Int32), ("start", Int64), ("leader_epoch", Int32), *lag,
                              ("error", Int16), ("message", _STR), _TAGS)
    topics = CompactArray(("topic", _STR), ("topic_id", _UUID), ("partitions", partitions), _TAGS)
    return Schema(("throttle", Int32), ("groups", CompactArray(
        ("group", _STR), ("topics", topics), ("error", Int16), ("message", _STR), _TAGS)))


class _Connection:
    def __init__(self, host: str, port: int, kafka: KafkaSettings, timeout_s: float) -> None:
        sock = socket.create_connection((host, port), timeout=timeout_s)
        context = kafka.ssl_context()  # None without TLS (SASL_SSL never gets here)
        if context is not None:
            sock = context.wrap_socket(sock, server_hostname=host)
        self.sock = sock
        self._answers = sock.makefile("rb")
        self.correlation = 0

    def ask(self, api: int, version: int, body: bytes, flexible: bool) -> BytesIO:
        """One request and its answer, read past the response header."""
        self.correlation += 1
        header = struct.pack(">hhih", api, version, self.correlation, len(_CLIENT_ID)) + _CLIENT_ID
        frame = header + (TaggedFields.encode({}) if flexible else b"") + body
        self.sock.sendall(struct.pack(">i", len(frame)) + frame)
        size = struct.unpack(">i", self._read(4))[0]
        answer = BytesIO(self._read(size))
        if Int32.decode(answer) != self.correlation:
            raise TransportError("DescribeShareGroupOffsets: an answer to another request")
        if flexible and api != API_VERSIONS:  # ApiVersions answers with header v0 whatever its version
            TaggedFields.decode(answer)
        return answer

    def _read(self, n: int) -> bytes:
        data = self._answers.read(n)  # buffered: reads until n bytes came, or the connection closed
        if len(data) < n:
            raise TransportError("the broker closed the connection")
        return data

    def versions(self) -> dict[int, tuple[int, int]]:
        error, apis = _API_VERSIONS_ANSWER.decode(self.ask(API_VERSIONS, 0, b"", flexible=False))
        if error:
            raise TransportError(f"ApiVersions: error code {error}")
        return {key: (low, high) for key, low, high in apis}

    def close(self) -> None:
        self._answers.close()
        self.sock.close()


def _coordinator(conn: _Connection, group: str) -> tuple[str, int]:
    ask = _FIND_COORDINATOR_ASK.encode((0, [group], {}))
    _, coordinators = _FIND_COORDINATOR_ANSWER.decode(conn.ask(FIND_COORDINATOR, 4, ask, flexible=True))
    for _, _, host, port, error, message, _ in coordinators:
        if error in _RETRIABLE:
            raise _Retry()
        if error:
            raise TransportError(f"FindCoordinator {group}: error code {error} {message or ''}".strip())
        return host, port
    raise TransportError(f"FindCoordinator {group}: no coordinator in the answer")


def _describe(conn: _Connection, version: int, group: str,
              partitions: dict[str, list[int]]) -> tuple[int, list[SharePartitionOffset]]:
    ask = _DESCRIBE_ASK.encode(([(group, [(t, ps, {}) for t, ps in partitions.items()], {})], {}))
    _, groups = _describe_answer(version).decode(conn.ask(DESCRIBE_SHARE_GROUP_OFFSETS, version, ask, flexible=True))
    found: list[SharePartitionOffset] = []
    error = 0
    for _, topics, error, _, _ in groups:
        for topic, _, answers, _ in topics:
            for partition, start, _, *lag, p_error, _, _ in answers:  # lag: [] in v0
                if not p_error:
                    found.append(SharePartitionOffset(topic, partition, start, lag[0] if lag and lag[0] >= 0 else None))
    return error, found


def share_group_offsets(kafka: KafkaSettings, group: str, partitions: dict[str, Iterable[int]],
                        timeout_s: float = 5.0) -> list[SharePartitionOffset]:
    """The start offset (and the broker's lag, where it gives one) of ``group`` on each partition of
    ``partitions`` ({topic: partition numbers}). A partition the group has no state on (or a group
    that does not exist yet) has start offset -1, or is left out.
    ``TransportError`` when the broker cannot be asked; ``ShareOffsetsUnsupported`` on SASL."""
    if kafka.security_protocol.startswith("SASL"):
        raise ShareOffsetsUnsupported(f"share group offsets over {kafka.security_protocol}: not implemented "
                                      "(confluent-kafka has no share group admin call)")
    wanted = {t: sorted(ps) for t, ps in partitions.items()}
    host, _, port = kafka.bootstrap_servers.split(",")[0].strip().rpartition(":")
    try:
        for attempt in range(5):
            conn = _Connection(host.strip("[]"), int(port), kafka, timeout_s)
            try:
                versions = conn.versions()
                if DESCRIBE_SHARE_GROUP_OFFSETS not in versions or versions.get(FIND_COORDINATOR, (0, 0))[1] < 4:
                    raise ShareOffsetsUnsupported("the broker has no DescribeShareGroupOffsets (Kafka 4.1+ has)")
                version = min(1, versions[DESCRIBE_SHARE_GROUP_OFFSETS][1])
                where = _coordinator(conn, group)
            except _Retry:
                time.sleep(0.5 * (attempt + 1))
                continue
            finally:
                conn.close()
            coordinator = _Connection(where[0], where[1], kafka, timeout_s)
            try:
                error, found = _describe(coordinator, version, group, wanted)
            finally:
                coordinator.close()
            if error == GROUP_ID_NOT_FOUND:
                return []
            if error in _RETRIABLE:  # the coordinator is loading or moved: find it again
                time.sleep(0.5 * (attempt + 1))
                continue
            if error:
                raise TransportError(f"DescribeShareGroupOffsets {group}: error code {error}")
            return found
        raise TransportError(f"DescribeShareGroupOffsets {group}: the coordinator kept moving")
    except (OSError, struct.error, ValueError) as exc:  # ValueError: an answer that does not parse
        raise TransportError(f"DescribeShareGroupOffsets {group} at {kafka.bootstrap_servers}: "
                             f"{type(exc).__name__}: {exc}") from exc
