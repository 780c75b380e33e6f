"""Jaeger and Prometheus as services of the local stack: their configs, command lines, health, addresses.

``chatpipe up --observability`` runs both beside the other services, under the same supervisor (started,
restarted with backoff, stopped by ``down``: ``infra.stack``); each service's own folder is
``<state>/<name>``:
- ``jaeger`` (trace store, UI): OTLP in on ``otlp_grpc_port`` / ``otlp_http_port`` (the services post
  their spans to ``http://<host>:<otlp_http_port>/v1/traces``), traces kept in memory (lost with the
  process: this is a developer's view, not an archive; ``<state>/traces`` keeps the files), the UI and
  query API (``/api/traces/<id>``, ``/api/v3/...``) on ``jaeger_port``; config ``<state>/jaeger/config.yaml``.
- ``prometheus`` (metrics store, UI): scrapes every service's ``/metrics`` (the gateway's, each inference
  worker's, each streams worker's: ``infra.instances``) and itself every ``scrape_interval_s``; config
  ``<state>/prometheus/prometheus.yml``, rewritten by every ``up`` (another worker count changes the
  targets; a running Prometheus is told with SIGHUP), data in ``<state>/prometheus/data``.

Everything listens on the stack's host (loopback by default). Plain logic and file writing; no process
is started here. Not here: building the programs (``binaries``), starting them (``infra.stack``).
"""

from __future__ import annotations

import json
from pathlib import Path

from infra import instances
from infra.local_kafka import http_status, port_open
from infra.observability.binaries import Installed
from infra.services import write_atomically
from infra.settings import StackSettings

JAEGER, PROMETHEUS = "jaeger", "prometheus"
BACKENDS = (JAEGER, PROMETHEUS)  # started after Kafka, before the services (stopped after them)
MAX_TRACES = 100_000  # Jaeger's in-memory store: the oldest trace goes first past this


def folder(settings: StackSettings, name: str) -> Path:
    return settings.state_dir.resolve() / name


def otlp_endpoint(settings: StackSettings) -> str:
    """What the services get as ``CHATPIPE_TRACING_OTLP_ENDPOINT`` (they post to ``<it>/v1/traces``)."""
    return f"http://{settings.host}:{settings.otlp_http_port}"


def ports(settings: StackSettings, name: str) -> dict[int, str]:
    """The ports ``name`` listens on -> the setting that chooses each (named when one is taken)."""
    if name == JAEGER:
        return {settings.otlp_grpc_port: "CHATPIPE_OTLP_GRPC_PORT", settings.otlp_http_port: "CHATPIPE_OTLP_HTTP_PORT",
                settings.jaeger_port: "CHATPIPE_JAEGER_PORT", settings.jaeger_grpc_port: "CHATPIPE_JAEGER_GRPC_PORT"}
    return {settings.prometheus_port: "CHATPIPE_PROMETHEUS_PORT"}


# --- configs ----------------------------------------------------------------------------------------
def jaeger_config(settings: StackSettings, ui: Path | None) -> dict:
    """Jaeger v2's config (an OpenTelemetry Collector's): OTLP in, the in-memory store, the query
    extension with the UI's assets when they are built (else Jaeger's placeholder page)."""
    host = settings.host
    # enable_tracing (on by default) would export Jaeger's own query spans to localhost:4317, retrying
    # while nothing listens there and holding its shutdown 10 s; the stack's traces are the services'.
    query: dict = {"storage": {"traces": "memstore"}, "enable_tracing": False,
                   "http": {"endpoint": f"{host}:{settings.jaeger_port}"},
                   "grpc": {"endpoint": f"{host}:{settings.jaeger_grpc_port}"}}
    if ui is not None:
        query["ui"] = {"assets_path": str(ui)}
    return {
        "service": {
            "extensions": ["jaeger_storage", "jaeger_query"],
            "pipelines": {"traces": {"receivers": ["otlp"], "processors": ["batch"],
                                     "exporters": ["jaeger_storage_exporter"]}},
            # Its own metrics would take one more port (8888 by default); its log is enough here.
            "telemetry": {"resource": {"service.name": "jaeger"}, "metrics": {"level": "none"},
                          "logs": {"level": "info"}},
        },
        "extensions": {"jaeger_query": query,
                       "jaeger_storage": {"backends": {"memstore": {"memory": {"max_traces": MAX_TRACES}}}}},
        "receivers": {"otlp": {"protocols": {"grpc": {"endpoint": f"{host}:{settings.otlp_grpc_port}"},
                                             "http": {"endpoint": f"{host}:{settings.otlp_http_port}"}}}},
        "processors": {"batch": {}},
        "exporters": {"jaeger_storage_exporter": {"trace_storage": "memstore"}},
    }


def scrape_targets(settings: StackSettings) -> dict[str, list[tuple[str, str]]]:
    """Job -> [(host:port, service name)]: every service of the stack that serves /metrics."""
    s, host = settings, settings.host
    return {
        "gateway": [(f"{host}:{s.gateway_port}", "gateway")],
        "inference": [(f"{host}:{instances.metrics_port(s, i)}", instances.instance_name(instances.INFERENCE, i))
                      for i in range(1, s.inference_workers + 1)],
        "streams": [(f"{host}:{instances.streams_metrics_port(s, i)}", instances.instance_name(instances.STREAMS, i))
                    for i in range(1, s.streams_workers + 1)],
        "prometheus": [(f"{host}:{s.prometheus_port}", PROMETHEUS)],
    }


def prometheus_config(settings: StackSettings) -> dict:
    """Prometheus's config: one job per kind of service, a ``service`` label naming the instance."""
    interval = f"{settings.scrape_interval_s:g}s"
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [{"job_name": job, "metrics_path": "/metrics",
                            "static_configs": [{"targets": [target], "labels": {"service": name}}
                                               for target, name in targets]}
                           for job, targets in scrape_targets(settings).items()],
    }


def config_file(settings: StackSettings, name: str) -> Path:
    return folder(settings, name) / ("config.yaml" if name == JAEGER else "prometheus.yml")


def write_config(settings: StackSettings, name: str, installed: Installed | None = None) -> bool:
    """Write ``name``'s config file (the Jaeger config needs ``installed``: where its UI is); True if it
    changed (a running Prometheus then reloads it)."""
    config = jaeger_config(settings, installed.jaeger_ui if installed else None) if name == JAEGER \
        else prometheus_config(settings)
    text = (f"# Written by `chatpipe up` for {settings.state_dir.resolve()}; rewritten by every `up`, so edits "
            f"here are lost.\n{to_yaml(config)}")
    path = config_file(settings, name)
    if path.exists() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, text)  # Prometheus may read it at any time (SIGHUP, a restart)
    return True


def to_yaml(value, indent: int = 0) -> str:
    """Block-style YAML of plain dicts, lists and scalars (scalars, and empty dicts and lists, as JSON,
    which YAML reads as is)."""
    pad = "  " * indent
    if isinstance(value, dict) and value:
        out = []
        for key, item in value.items():
            if isinstance(item, (dict, list)) and item:
                out.append(f"{pad}{key}:\n{to_yaml(item, indent + 1)}")
            else:
                out.append(f"{pad}{key}: {json.dumps(item)}\n")
        return "".join(out)
    if isinstance(value, list) and value:
        # "- " takes the place of the item's first indent: "- job_name: x\n  metrics_path: y"
        return "".join(f"{pad}- {to_yaml(item, indent + 1)[len(pad) + 2:]}" for item in value)
    return f"{pad}{json.dumps(value)}\n"


# --- running ----------------------------------------------------------------------------------------
def command(settings: StackSettings, name: str, installed: Installed) -> tuple[list[str], Path]:
    """(argv, working folder) of ``name``. Prometheus runs in its UI's folder: built without the
    ``builtinassets`` tag, it serves its pages from ``./static`` (``web/ui/ui.go``)."""
    home = folder(settings, name)
    if name == JAEGER:
        return [str(installed.jaeger), "--config", str(config_file(settings, JAEGER))], home
    return ([str(installed.prometheus), f"--config.file={config_file(settings, PROMETHEUS)}",
             f"--storage.tsdb.path={home / 'data'}", f"--web.listen-address={settings.host}:{settings.prometheus_port}",
             "--storage.tsdb.retention.time=2d"],
            installed.prometheus_ui or home)


def not_ready(settings: StackSettings, name: str) -> str:
    """Why the running ``name`` is not healthy yet ("" when it is): Jaeger's query API answers and its
    OTLP/HTTP port takes connections; Prometheus says it is ready."""
    s = settings
    if name == JAEGER:
        code = http_status(f"http://{s.host}:{s.jaeger_port}/api/services")
        if code != 200:
            return f"query API /api/services answers {code or 'nothing'}"
        return "" if port_open(s.host, s.otlp_http_port) else f"OTLP/HTTP :{s.otlp_http_port} not open"
    code = http_status(f"http://{s.host}:{s.prometheus_port}/-/ready")
    return "" if code == 200 else f"/-/ready answers {code or 'nothing'}"


def address(settings: StackSettings, name: str, installed: Installed | None) -> str:
    s = settings
    if name == JAEGER:
        ui = "UI" if installed is not None and installed.jaeger_ui else "query API; UI not built"
        return f"http://{s.host}:{s.jaeger_port} ({ui}), OTLP {s.host}:{s.otlp_grpc_port} gRPC, :{s.otlp_http_port} HTTP"
    targets = sum(len(t) for t in scrape_targets(s).values())
    ui = "" if installed is not None and installed.prometheus_ui else "; UI not built"
    return f"http://{s.host}:{s.prometheus_port} ({targets} scrape targets{ui})"
