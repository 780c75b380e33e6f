"""The whole local stack of one state folder: Kafka, the streams worker, an inference worker, the gateway.

``LocalStack.up`` starts what is not running (Kafka first, then the three services side by side,
each a detached ``chatpipe <cmd>`` process with its log under ``<state>/logs``) and waits until
every one is healthy; ``down`` stops them in reverse dependency order; ``status`` probes each.

Health, per service (``probe``):
- kafka: its process runs and the broker answers a metadata request;
- streams: its process runs and its Faust consumer group has members (it has joined and owns partitions);
- inference: its process runs, ``/metrics`` answers (the model is loaded) and its consumer group
  has members;
- gateway: ``GET /healthz`` answers 200 (its reply consumer is assigned).

Not here: how one process is started and stopped (``infra.services``), the broker itself
(``infra.local_kafka``), what was saved about the stack (``infra.stack_state``).
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from infra import stack_state
from infra.local_kafka import LocalKafka, PortInUseError, StackError, port_open
from infra.local_keys import ensure_keys_file
from infra.services import ServiceProcess, StopResult
from infra.settings import StackSettings

KAFKA = "kafka"
SERVICES = ("streams", "inference", "gateway")  # started after Kafka; stopped before it, in reverse
ALL = (KAFKA, *SERVICES)

# The groups the services join with their default settings (streams: the Faust app id;
# inference: the worker's consumer group). Literal here so `up` does not import either service.
STREAMS_GROUP = "chatpipe-streams"
INFERENCE_GROUP = "chatpipe-inference"

_no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via a proxy


class ServiceStartError(StackError):
    """A service exited or stayed unhealthy while ``up`` waited for it."""


@dataclass(frozen=True, slots=True)
class Health:
    name: str
    healthy: bool
    state: str  # "healthy" | "starting" | "unhealthy" | "stopped" | "not started"
    pid: int | None
    address: str
    log: Path
    detail: str = ""


def broker_for(settings: StackSettings):
    """The Kafka of this stack: one broker (``LocalKafka``), or a KRaft cluster for ``brokers`` > 1.

    ``LocalStack`` uses of it: ``up() -> bool`` (False: was running), ``down() -> bool`` (False: was
    not running), ``killed`` (the last down needed SIGKILL), ``pid()``, ``status()`` (``.pid``,
    ``.running``), ``answers()``, ``logs_dir``; and ``LocalStack.bootstrap_servers`` for the clients.
    """
    if settings.brokers > 1:
        from infra.cluster_broker import ClusterBroker

        return ClusterBroker(settings)
    return LocalKafka(settings)


def _http_status(url: str) -> int | None:
    try:
        with _no_proxy.open(url, timeout=2) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, ValueError):
        return None


class LocalStack:
    def __init__(self, settings: StackSettings, services: list[str] | None = None) -> None:
        self.settings = settings
        self.kafka = broker_for(settings)
        self.processes = {name: ServiceProcess(name, settings) for name in SERVICES}
        # Services this stack was started with (`up --only kafka`: Kafka alone); None = all.
        self.services = list(ALL) if services is None else [s for s in ALL if s in services]
        self._admin = None

    @classmethod
    def open(cls, settings: StackSettings) -> "LocalStack":
        """The stack of ``settings.state_dir`` with what was saved there merged in (``stack_state``)."""
        probe = cls(settings)
        merged, services = stack_state.resolve(settings, running=probe.running_services())
        return cls(merged, services)

    def running_services(self) -> set[str]:
        """The services of this state folder whose process runs (ports are not needed to tell)."""
        running = {name for name, proc in self.processes.items() if proc.pid() is not None}
        return running | {KAFKA} if self.kafka.pid() is not None else running

    @property
    def bootstrap_servers(self) -> str:
        """What the services and the admin client connect to (every node of a cluster)."""
        return getattr(self.kafka, "bootstrap_servers", self.settings.bootstrap_servers)

    # --- what each service is started with ---------------------------------------------------
    def command(self, name: str) -> list[str]:
        s = self.settings
        kafka = ["--bootstrap-servers", self.bootstrap_servers] + (["--topic-prefix", s.topic_prefix] if s.topic_prefix else [])
        state = s.state_dir.resolve()
        if name == "streams":
            return ["streams", *kafka, "--state-dir", str(state / "streams"), "--archive-dir", str(state / "archive"),
                    "--memory-path", str(state / "qdrant")]
        if name == "inference":
            # Partition intake (a consumer group) always: its members are how `up` sees the worker
            # serving; a share group is not listed by the admin API (run `chatpipe inference
            # --intake share` by hand for that).
            return ["inference", *kafka, "--intake", "partition", "--metrics-port", str(s.worker_metrics_port)]
        if name == "gateway":
            return ["gateway", *kafka, "--host", s.host, "--port", str(s.gateway_port), "--keys-file", str(s.keys_file)]
        raise ValueError(f"no service {name!r}")

    def service_env(self) -> dict[str, str]:
        """Variables every service gets: on a cluster, the topics they create themselves (Faust's
        changelog, the gateway's reply topic) are replicated like the catalog's."""
        return {"CHATPIPE_REPLICATION_FACTOR": "3"} if self.settings.brokers >= 3 else {}

    def address(self, name: str) -> str:
        s = self.settings
        kafka = (f"{self.bootstrap_servers} ({s.brokers} nodes)" if s.brokers > 1
                 else f"{self.bootstrap_servers} (controller :{s.controller_port})")
        return {KAFKA: kafka,
                "streams": f"group {s.topic_prefix}{STREAMS_GROUP}",
                "inference": f"http://{s.host}:{s.worker_metrics_port}/metrics",
                "gateway": s.gateway_url}[name]

    def log_file(self, name: str) -> Path:
        return self.kafka.logs_dir / "server.log" if name == KAFKA else self.processes[name].log_file

    # --- health ------------------------------------------------------------------------------
    def admin(self):
        if self._admin is None:
            from transport.admin import TopicAdmin
            from transport.settings import KafkaSettings

            self._admin = TopicAdmin(KafkaSettings(bootstrap_servers=self.bootstrap_servers,
                                                   topic_prefix=self.settings.topic_prefix), timeout_s=5.0)
        return self._admin

    def _members(self, group: str) -> int:
        from transport.errors import TransportError

        try:
            return self.admin().group_members(f"{self.settings.topic_prefix}{group}")
        except TransportError:
            return 0

    def probe(self, name: str) -> Health:
        address, log = self.address(name), self.log_file(name)
        if name == KAFKA:
            st = self.kafka.status()
            if st.pid is None:
                return Health(name, False, "stopped", None, address, log)
            ok = st.running and self.kafka.answers()
            return Health(name, ok, "healthy" if ok else "unhealthy", st.pid, address, log,
                          "" if ok else "the broker does not answer")
        pid = self.processes[name].pid()
        if pid is None:
            state = "stopped" if name in self.services else "not started"
            return Health(name, False, state, None, address, log)
        detail = self._not_ready(name)
        return Health(name, not detail, "unhealthy" if detail else "healthy", pid, address, log, detail)

    def _not_ready(self, name: str) -> str:
        """Why the running service ``name`` is not healthy yet ("" when it is)."""
        s = self.settings
        if name in ("streams", "inference") and self.kafka.pid() is None:
            return "Kafka is not running"  # no group to ask about (and no 5 s admin timeout per probe)
        if name == "gateway":
            code = _http_status(f"{s.gateway_url}/healthz")
            return "" if code == 200 else f"/healthz answers {code or 'nothing'}"
        if name == "inference":
            if _http_status(f"http://{s.host}:{s.worker_metrics_port}/metrics") != 200:
                return "loading the model (/metrics not up yet)"
            return "" if self._members(INFERENCE_GROUP) else "joining its consumer group"
        if name == "streams":
            return "" if self._members(STREAMS_GROUP) else "loading models / joining its consumer group"
        raise ValueError(f"no service {name!r}")

    def status(self) -> list[Health]:
        return [self.probe(name) for name in ALL]

    # --- up / down ---------------------------------------------------------------------------
    def up(self, only: list[str] | None = None, *,
           on_ready: Callable[[Health, bool, float], None] = lambda h, started, s: None,
           on_topics: Callable[[list], None] = lambda changes: None,
           on_wait: Callable[[dict[str, str], float], None] = lambda pending, s: None) -> None:
        """Start Kafka (and apply the topic catalog) and the ``only`` services (all by default) that do not
        run; wait until each is healthy.

        ``on_ready(health, started_now, seconds)`` once per service; ``on_topics(changes)`` after the
        catalog is applied; ``on_wait({name: why}, seconds)`` while some are not healthy yet.
        """
        wanted = [n for n in SERVICES if only is None or n in only]
        began = time.monotonic()
        started = self.kafka.up()
        running_before = [n for n in SERVICES if self.processes[n].pid() is not None]
        self.services = [KAFKA, *[n for n in SERVICES if n in wanted or n in running_before]]
        stack_state.save(self.settings, self.services)
        on_ready(self.probe(KAFKA), started, time.monotonic() - began)
        on_topics(self.admin().apply())  # before the services: they expect every catalog topic
        if "gateway" in wanted:
            ensure_keys_file(self.settings.keys_file)
        fresh = [n for n in wanted if n not in running_before]
        self._check_ports(fresh)
        for name in fresh:
            self.processes[name].start(self.command(name), self.service_env())
        self._wait_healthy(wanted, fresh, on_ready, on_wait)

    def _check_ports(self, fresh: list[str]) -> None:
        ports = {"gateway": ("--gateway-port", self.settings.gateway_port),
                 "inference": ("--worker-metrics-port", self.settings.worker_metrics_port)}
        for name in fresh:
            if name in ports and port_open(self.settings.host, ports[name][1]):
                flag, port = ports[name]
                raise PortInUseError(f"port {port} on {self.settings.host} ({name}) is already in use by another "
                                     f"program; stop it or choose another port with {flag}")

    def _wait_healthy(self, wanted, fresh, on_ready, on_wait) -> None:
        began = time.monotonic()
        pending = {name: "starting" for name in wanted}
        while pending:
            for name in list(pending):
                proc = self.processes[name]
                if proc.pid() is None:
                    code = proc.exit_code()
                    raise ServiceStartError(
                        f"{name} exited{f' with code {code}' if code is not None else ''} while starting "
                        f"(the other services keep running; `chatpipe down` stops them). "
                        f"Last lines of {proc.log_file}:\n{proc.log_tail()}")
                detail = self._not_ready(name)
                if detail:
                    pending[name] = detail
                    continue
                del pending[name]
                on_ready(self.probe(name), name in fresh, time.monotonic() - began)
            if not pending:
                return
            elapsed = time.monotonic() - began
            if elapsed > self.settings.service_start_timeout_s:
                name, why = next(iter(pending.items()))
                raise ServiceStartError(
                    f"{name} is not healthy after {elapsed:.0f} s ({why}); it keeps running, see "
                    f"`chatpipe status`. Last lines of {self.processes[name].log_file}:\n{self.processes[name].log_tail()}")
            on_wait(dict(pending), elapsed)
            time.sleep(0.5)

    def down(self, on_stopped: Callable[[StopResult], None] = lambda r: None) -> list[StopResult]:
        """Stop every service (gateway, inference, streams), then Kafka: SIGTERM, SIGKILL after the timeout."""
        results = []
        for name in reversed(SERVICES):
            result = self.processes[name].stop(self.settings.stop_timeout_s)
            on_stopped(result)
            results.append(result)
        began, pid = time.monotonic(), self.kafka.pid()
        stopped = self.kafka.down()
        outcome = ("killed" if self.kafka.killed else "stopped") if stopped else "not running"
        result = StopResult(KAFKA, outcome, pid, time.monotonic() - began)
        on_stopped(result)
        results.append(result)
        return results
