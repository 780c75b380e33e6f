"""Every schema version we hold, by name and version, each with its CRC-64-AVRO fingerprint.

All versions of every schema stay in ``schemas/avro/`` as ``<Name>.v<N>.avsc``: a reader
finds the writer's schema from the fingerprint in the message, and resolves it to the newest
version of the same name (Avro schema resolution). Schemas are parsed once per process.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from fastavro.schema import fingerprint, parse_schema, to_parsing_canonical_form

from schemas.errors import SchemaError

SCHEMA_DIR = Path(__file__).parent / "avro"
_FILE_NAME = re.compile(r"^(?P<name>[A-Za-z]+)\.v(?P<version>\d+)\.avsc$")


@dataclass(frozen=True, slots=True)
class SchemaVersion:
    name: str  # Avro record name without namespace, e.g. "ConversationTurn"
    version: int
    parsed: Any  # fastavro parsed schema
    fingerprint: bytes  # 8 bytes, little-endian CRC-64-AVRO, as written on the wire


def crc64_fingerprint(schema: dict | str) -> bytes:
    """The 8-byte little-endian CRC-64-AVRO fingerprint of a schema's canonical form."""
    canonical = to_parsing_canonical_form(schema)
    # fastavro's hex string is already the little-endian byte order of the 64-bit value
    # (checked against the spec's vector for "null" in tests/schemas/test_codec.py).
    return bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO"))


class SchemaRegistry:
    """In-process view of ``schemas/avro``: no server, no network."""

    def __init__(self, schema_dir: Path = SCHEMA_DIR) -> None:
        self._latest: dict[str, SchemaVersion] = {}
        self._versions: dict[str, dict[int, SchemaVersion]] = {}
        files = sorted(schema_dir.glob("*.avsc"))
        if not files:
            raise SchemaError(f"no *.avsc files in {schema_dir}")
        for path in files:
            self._add(path)

    def _add(self, path: Path) -> None:
        match = _FILE_NAME.match(path.name)
        if not match:
            raise SchemaError(f"{path.name}: schema files are named <Name>.v<N>.avsc")
        try:
            raw = json.loads(path.read_text())
            parsed = parse_schema(raw)  # marked parsed: fastavro then skips re-parsing it per call (2x per record)
        except Exception as exc:  # any parse failure is a broken build, name the file
            raise SchemaError(f"{path}: not a valid Avro schema: {exc}") from exc
        name, version = match["name"], int(match["version"])
        if raw.get("name") != name:
            raise SchemaError(f"{path}: record name {raw.get('name')!r} does not match file name")
        entry = SchemaVersion(name, version, parsed, crc64_fingerprint(raw))
        self._versions.setdefault(name, {})[version] = entry
        if name not in self._latest or version > self._latest[name].version:
            self._latest[name] = entry

    def latest(self, name: str) -> SchemaVersion:
        try:
            return self._latest[name]
        except KeyError:
            raise SchemaError(f"no schema named {name!r}; known: {sorted(self._latest)}") from None

    def version(self, name: str, version: int) -> SchemaVersion:
        try:
            return self._versions[name][version]
        except KeyError:
            raise SchemaError(f"no schema {name} v{version}") from None

    def names(self) -> list[str]:
        return sorted(self._latest)

    def all_versions(self) -> list[SchemaVersion]:
        return [v for versions in self._versions.values() for v in versions.values()]


@cache
def default_registry() -> SchemaRegistry:
    """The registry of the schemas shipped in this package, parsed once per process."""
    return SchemaRegistry()
