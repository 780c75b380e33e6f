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
from typing import Iterable

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


# --- the wire format ---------------------------------------------------------------------------

def _uvarint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _compact_str(s: str) -> bytes:
    raw = s.encode()
    return _uvarint(len(raw) + 1) + raw


def _compact_array(items: list[bytes]) -> bytes:
    return _uvarint(len(items) + 1) + b"".join(items)


_TAGS = b"\x00"  # no tagged fields


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, fmt: str):
        value = struct.unpack_from(fmt, self.data, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def uvarint(self) -> int:
        shift = result = 0
        while True:
            byte = self.data[self.pos]
            self.pos += 1
            result |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return result
            shift += 7

    def compact_str(self) -> str | None:
        n = self.uvarint() - 1
        if n < 0:
            return None
        value = self.data[self.pos:self.pos + n].decode()
        self.pos += n
        return value

    def skip_tags(self) -> None:
        for _ in range(self.uvarint()):
            self.uvarint()  # tag
            self.pos += self.uvarint()  # size, then the value


class _Connection:
    def __init__(self, host: str, port: int, kafka: KafkaSettings, timeout_s: float) -> None:
        sock = socket.create_connection((host, port), timeout=timeout_s)
        context = kafka.ssl_context()  # None without TLS (SASL_SSL never gets here)
        if context is not None:
            sock = context.wrap_socket(sock, server_hostname=host)
        self.sock = sock
        self._answers = sock.makefile("rb")
        self.correlation = 0

    def ask(self, api: int, version: int, body: bytes, flexible: bool) -> _Reader:
        """One request and its answer; the reader is past the response header."""
        self.correlation += 1
        header = struct.pack(">hhih", api, version, self.correlation, len(_CLIENT_ID)) + _CLIENT_ID
        frame = header + (_TAGS if flexible else b"") + body
        self.sock.sendall(struct.pack(">i", len(frame)) + frame)
        size = struct.unpack(">i", self._read(4))[0]
        reader = _Reader(self._read(size))
        if reader.take(">i") != self.correlation:
            raise TransportError("DescribeShareGroupOffsets: an answer to another request")
        if flexible and api != API_VERSIONS:  # ApiVersions answers with header v0 whatever its version
            reader.skip_tags()
        return reader

    def _read(self, n: int) -> bytes:
        data = self._answers.read(n)  # buffered: reads until n bytes came, or the connection closed
        if len(data) < n:
            raise TransportError("the broker closed the connection")
        return data

    def versions(self) -> dict[int, tuple[int, int]]:
        r = self.ask(API_VERSIONS, 0, b"", flexible=False)
        error = r.take(">h")
        if error:
            raise TransportError(f"ApiVersions: error code {error}")
        out = {}
        for _ in range(r.take(">i")):
            key, low, high = r.take(">h"), r.take(">h"), r.take(">h")
            out[key] = (low, high)
        return out

    def close(self) -> None:
        self._answers.close()
        self.sock.close()


def _coordinator(conn: _Connection, group: str) -> tuple[str, int]:
    r = conn.ask(FIND_COORDINATOR, 4, b"\x00" + _compact_array([_compact_str(group)]) + _TAGS, flexible=True)
    r.take(">i")  # throttle
    for _ in range(r.uvarint() - 1):
        r.compact_str()  # the key: the group
        r.take(">i")  # node id
        host, port = r.compact_str(), r.take(">i")
        error, message = r.take(">h"), r.compact_str()
        r.skip_tags()
        if error in _RETRIABLE:
            raise _Retry()
        if error:
            raise TransportError(f"FindCoordinator {group}: error code {error} {message or ''}".strip())
        return host, port
    raise TransportError(f"FindCoordinator {group}: no coordinator in the answer")


def _describe(conn: _Connection, version: int, group: str,
              partitions: dict[str, list[int]]) -> tuple[int, list[SharePartitionOffset]]:
    topics = [_compact_str(t) + _compact_array([struct.pack(">i", p) for p in ps]) + _TAGS
              for t, ps in partitions.items()]
    body = _compact_array([_compact_str(group) + _compact_array(topics) + _TAGS]) + _TAGS
    r = conn.ask(DESCRIBE_SHARE_GROUP_OFFSETS, version, body, flexible=True)
    r.take(">i")  # throttle
    found: list[SharePartitionOffset] = []
    error = 0
    for _ in range(r.uvarint() - 1):
        r.compact_str()  # group id
        for _ in range(r.uvarint() - 1):
            topic = r.compact_str()
            r.pos += 16  # topic id
            for _ in range(r.uvarint() - 1):
                partition, start = r.take(">i"), r.take(">q")
                r.take(">i")  # leader epoch
                lag = r.take(">q") if version >= 1 else -1
                p_error = r.take(">h")
                r.compact_str()  # its message
                r.skip_tags()
                if not p_error:
                    found.append(SharePartitionOffset(topic, partition, start, lag if lag >= 0 else None))
            r.skip_tags()
        error = r.take(">h")
        r.compact_str()  # its message
        r.skip_tags()
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
    except (OSError, struct.error, IndexError, UnicodeDecodeError) as exc:
        raise TransportError(f"DescribeShareGroupOffsets {group} at {kafka.bootstrap_servers}: "
                             f"{type(exc).__name__}: {exc}") from exc
