"""The instances of a scaled service of the local stack: names, and what one instance needs of its own.

``chatpipe up --streams-workers N --inference-workers M`` runs N streams workers and M inference
workers, all in their kind's one consumer group (that is the point: the group splits the partitions
between them). Instance 1 keeps the plain name (``streams``, ``inference``), so every command and
test that names a service goes on working; the others are ``streams-2``, ``streams-3``, ...,
``inference-2``, .... Each instance has its own pid file and log (by name, ``infra.services``).

What an instance has of its own (``instance_dir``, ``metrics_port``, ``streams_metrics_port``,
``instance_env``): a streams worker its Faust data folder (``<state>/<name>``), its /metrics port
(``streams_metrics_port`` + index - 1) and, when ``CHATPIPE_STREAMS_WEB_PORT`` is set, Faust's web
port plus its index - 1; an inference worker its /metrics port (``worker_metrics_port`` + index - 1)
and, when ``CHATPIPE_WORKER_WORKER_ID`` is set, that id with ``-<index>`` (left alone, each worker names itself ``<host>-<pid>``). Shared by all: the archive
folder (each partition's files are written by the one worker that owns it) and the Qdrant server.

Plain logic, no processes. Not here: starting or probing them (``infra.stack``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Mapping

from infra.settings import StackSettings

STREAMS, INFERENCE = "streams", "inference"
_INSTANCE = re.compile(r"^(streams|inference)(?:-([1-9][0-9]*))?$")


def instance_name(kind: str, index: int) -> str:
    """("streams", 1) -> "streams"; ("streams", 2) -> "streams-2"."""
    return kind if index == 1 else f"{kind}-{index}"


def instance_names(kind: str, count: int) -> list[str]:
    return [instance_name(kind, i) for i in range(1, count + 1)]


def parse_instance(name: str) -> tuple[str, int] | None:
    """"streams-2" -> ("streams", 2); "inference" -> ("inference", 1); None for any other name
    ("streams-1" too: instance 1 is only ever called "streams")."""
    match = _INSTANCE.match(name)
    if match is None or match.group(2) == "1":
        return None
    return match.group(1), int(match.group(2) or 1)


def kind_of(name: str) -> str:
    """The kind of a service name: "inference-2" -> "inference"; "gateway" -> "gateway"."""
    parsed = parse_instance(name)
    return parsed[0] if parsed else name


def metrics_port(settings: StackSettings, index: int) -> int:
    """Inference worker ``index``'s /metrics port: one after the other from ``worker_metrics_port``."""
    return settings.worker_metrics_port + index - 1


def streams_metrics_port(settings: StackSettings, index: int) -> int:
    """Streams worker ``index``'s /metrics port: one after the other from ``streams_metrics_port``."""
    return settings.streams_metrics_port + index - 1


def instance_dir(settings: StackSettings, name: str) -> Path:
    """A streams worker's Faust data folder: ``<state>/streams``, ``<state>/streams-2``, ..."""
    return settings.state_dir.resolve() / name


def instance_env(name: str, environ: Mapping[str, str]) -> dict[str, str]:
    """Variables instance ``name`` gets instead of those of ``environ`` (the environment of ``up``), where a
    value given once would otherwise be the same for every instance: a port, a worker id."""
    kind, index = parse_instance(name) or (name, 1)
    env: dict[str, str] = {}
    if index == 1:
        return env
    web_port = environ.get("CHATPIPE_STREAMS_WEB_PORT", "").strip()
    if kind == STREAMS and web_port.isdigit():  # anything else: the worker's own settings say what is wrong
        env["CHATPIPE_STREAMS_WEB_PORT"] = str(int(web_port) + index - 1)
    if kind == INFERENCE and environ.get("CHATPIPE_WORKER_WORKER_ID", "").strip():
        env["CHATPIPE_WORKER_WORKER_ID"] = f"{environ['CHATPIPE_WORKER_WORKER_ID'].strip()}-{index}"
    return env


def found_instances(run_dir: Path) -> set[str]:
    """Instance names that have a pid file in ``run_dir`` (running or not): ones beyond the stack's count
    that an earlier ``up`` started are found this way."""
    return {path.stem for path in run_dir.glob("*.pid") if parse_instance(path.stem) is not None}
