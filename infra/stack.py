"""The whole local stack of one state folder: Kafka, the streams worker, an inference worker, the gateway.

``LocalStack.up`` asks the stack's supervisor (``infra.supervisor``, a detached ``chatpipe supervise``)
to run what is not running (Kafka first, then the three services side by side, each a ``chatpipe
<cmd>`` process with its log under ``<state>/logs``) and waits until every one is healthy; the
supervisor starts again any that exits, with backoff. ``down`` sends the supervisor away first (so
nothing is restarted), then stops the services in reverse dependency order; ``restart`` and ``stop``
act on one service through the supervisor; ``status`` probes each and adds its restarts and last exit.

Health, per service (``probe``):
- kafka: its process runs and the broker answers a metadata request;
- streams: its process runs and its Faust consumer group has members (it has joined and owns partitions);
- inference: its process runs, ``/metrics`` answers (the model is loaded) and its consumer group
  has members;
- gateway: ``GET /healthz`` answers 200 (its reply consumer is assigned).

Supervised: every service, and the broker of a one-broker stack (a cluster's nodes are not: ``chatpipe
cluster node kill`` stops them on purpose). A service found running that the supervisor did not start
(a stack started by an older chatpipe, a broker started by a test fixture) is left alone and shown as
unsupervised; ``down`` stops it as before.

Not here: how one process is stopped (``infra.services``), the broker itself (``infra.local_kafka``),
the supervisor and its files (``infra.supervisor``, ``infra.supervision``), what was saved about the
stack (``infra.stack_state``).
"""

from __future__ import annotations

import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from infra import stack_state
from infra.local_kafka import LocalKafka, PortInUseError, StackError, port_open
from infra.local_keys import ensure_keys_file
from infra.services import ServiceProcess, StopResult, tail
from infra.settings import StackSettings
from infra.supervision import (ExitRecord, ServiceSpec, ServiceState, Spec, SupervisorClient, SupervisorState,
                               happened)

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
    state: str  # "healthy" | "unhealthy" | "restarting" (the supervisor waits out a backoff) | "stopped" | "not started"
    pid: int | None
    address: str
    log: Path
    detail: str = ""
    supervised: bool = False  # the supervisor of this stack runs it (and starts it again when it exits)
    restarts: int | None = None  # restarts after an exit nobody asked for; None: never supervised
    last_exit: ExitRecord | None = None


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
        self.supervisor = SupervisorClient(settings)
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
        return {name for name in ALL if self._pid(name) is not None}

    def _pid(self, name: str) -> int | None:
        return self.kafka.pid() if name == KAFKA else self.processes[name].pid()

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
            memory = ["--qdrant-url", s.qdrant_url] if s.qdrant_url else ["--memory-path", str(state / "qdrant")]
            return ["streams", *kafka, "--state-dir", str(state / "streams"), "--archive-dir", str(state / "archive"),
                    *memory]
        if name == "inference":
            # Partition intake (a consumer group) always: its members are how `up` sees the worker
            # serving; a share group is not listed by the admin API (run `chatpipe inference
            # --intake share` by hand for that).
            return ["inference", *kafka, "--intake", "partition", "--metrics-port", str(s.worker_metrics_port)]
        if name == "gateway":
            return ["gateway", *kafka, "--host", s.host, "--port", str(s.gateway_port), "--keys-file", str(s.keys_file)]
        raise ValueError(f"no service {name!r}")

    def service_env(self) -> dict[str, str]:
        """Variables every service gets besides those of the `chatpipe up` that starts it: on a
        cluster, the topics they create themselves (Faust's changelog, the gateway's reply topic)
        are replicated like the catalog's."""
        return {"CHATPIPE_REPLICATION_FACTOR": "3"} if self.settings.brokers >= 3 else {}

    def _service_spec(self, name: str) -> ServiceSpec:
        """What the supervisor runs for ``name``, with the environment of this process (``up``'s)."""
        env = {**os.environ, **self.service_env()}
        if name == KAFKA:
            k = self.kafka
            return ServiceSpec(KAFKA, tuple(k.prepare()), env, str(k.stdout_file), str(k.pid_file), cwd=str(k.dir),
                               tail_file=str(k.logs_dir / "server.log"))
        proc = self.processes[name]
        return ServiceSpec(name, (sys.executable, "-m", "chatpipe.cli", *self.command(name)), env,
                           str(proc.log_file), str(proc.pid_file))

    def address(self, name: str) -> str:
        s = self.settings
        kafka = (f"{self.bootstrap_servers} ({s.brokers} nodes)" if s.brokers > 1
                 else f"{self.bootstrap_servers} (controller :{s.controller_port})")
        memory = f", qdrant {s.qdrant_url}" if s.qdrant_url else ""
        return {KAFKA: kafka,
                "streams": f"group {s.topic_prefix}{STREAMS_GROUP}{memory}",
                "inference": f"http://{s.host}:{s.worker_metrics_port}/metrics",
                "gateway": s.gateway_url}[name]

    def log_file(self, name: str) -> Path:
        return self.kafka.logs_dir / "server.log" if name == KAFKA else self.processes[name].log_file

    def log_tail(self, name: str, lines: int = 20) -> str:
        if name == KAFKA:
            return f"{tail(self.kafka.logs_dir / 'broker.out', lines)}\n{tail(self.log_file(KAFKA), lines)}"
        return self.processes[name].log_tail(lines)

    # --- the supervisor ----------------------------------------------------------------------
    def supervised(self) -> dict[str, ServiceSpec]:
        """The services the running supervisor has in hand (wanted or held stopped); {} if none runs."""
        if self.supervisor.pid() is None:
            return {}
        return {service.name: service for service in self.supervisor.spec().services}

    def _ask(self, entries: dict[str, ServiceSpec]) -> Spec:
        """Hand ``entries`` to the supervisor (starting one if needed) and wait until it has acted."""

        def change(spec: Spec, supervisor_runs: bool) -> Spec:
            if not supervisor_runs:  # left by a supervisor that is gone: what still runs is adopted, the rest forgotten
                spec = spec.without({s.name for s in spec.services if not (s.wanted and self._pid(s.name) is not None)})
            for name, entry in entries.items():
                old = spec.get(name)
                spec = spec.put(replace(entry, generation=old.generation if old else 0), ALL)
            return spec

        new, _ = self.supervisor.update(change)
        if any(s.wanted for s in new.services):
            self.supervisor.wait_applied(new.revision)
        return new

    def _exit_since(self, name: str, since: float) -> str | None:
        """How ``name`` ended if it exited (unasked) since ``since`` (wall clock); None while it runs or
        waits to be restarted without having exited since."""
        record = self._record(name)
        if record is not None and name in self.supervised():
            return next((e.reason for e in reversed(record.exits) if e.at >= since and not e.requested), None)
        return None if self._pid(name) is not None else "exited"

    def _record(self, name: str) -> ServiceState | None:
        state: SupervisorState | None = self.supervisor.state()
        return state.services.get(name) if state is not None else None

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
        held = self.supervised().get(name)
        record = self._record(name)
        extra = {"supervised": held is not None and held.wanted,
                 "restarts": record.restarts if record is not None else None,
                 "last_exit": record.last_exit if record is not None else None}
        pid = self._pid(name)
        if pid is None:
            if held is not None and not held.wanted:
                return Health(name, False, "stopped", None, address, log, f"by `chatpipe stop`; `chatpipe restart "
                                                                          f"{name}` starts it", **extra)
            if held is not None and record is not None and record.state in ("backoff", "running"):
                when = max(0.0, (record.next_start_at or time.time()) - time.time())
                why = record.last_exit.reason if record.last_exit else "exited"
                return Health(name, False, "restarting", None, address, log, f"{why}; next start in {when:.0f} s",
                              **extra)
            state = "stopped" if name in self.services else "not started"
            return Health(name, False, state, None, address, log, **extra)
        detail = self._not_ready(name)
        return Health(name, not detail, "unhealthy" if detail else "healthy", pid, address, log, detail, **extra)

    def _not_ready(self, name: str) -> str:
        """Why the running service ``name`` is not healthy yet ("" when it is)."""
        s = self.settings
        if name == KAFKA:
            return "" if self.kafka.status().running and self.kafka.answers() else "the broker does not answer"
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
        run, under the supervisor; wait until each is healthy.

        ``on_ready(health, started_now, seconds)`` once per service; ``on_topics(changes)`` after the
        catalog is applied; ``on_wait({name: why}, seconds)`` while some are not healthy yet.
        """
        wanted = [n for n in SERVICES if only is None or n in only]
        began, asked_at = time.monotonic(), time.time()
        started = self._up_kafka(asked_at)
        supervised = self.supervised()
        self.services = [KAFKA, *[n for n in SERVICES if n in wanted or n in supervised or self._pid(n) is not None]]
        stack_state.save(self.settings, self.services)
        on_ready(self.probe(KAFKA), started, time.monotonic() - began)
        on_topics(self.admin().apply())  # before the services: they expect every catalog topic
        if "gateway" in wanted:
            ensure_keys_file(self.settings.keys_file)
        # Not running: started (or, if the supervisor waits to restart it, given this command line
        # and environment for that start). Running: left alone, supervised or not.
        entries = {n: self._service_spec(n) for n in wanted if self._pid(n) is None}
        fresh = [n for n in entries if not (n in supervised and supervised[n].wanted)]
        self._check_ports(fresh)
        if entries:
            self._ask(entries)
        self._wait_healthy(wanted, fresh, asked_at, on_ready, on_wait)

    def _up_kafka(self, asked_at: float) -> bool:
        """Kafka up and answering; True if this call started it."""
        if self.settings.brokers > 1:
            return self.kafka.up()  # a cluster's nodes are not supervised (`chatpipe cluster node ...`)
        supervised = self.supervised()
        entry = {}
        if self.kafka.pid() is None and not (KAFKA in supervised and supervised[KAFKA].wanted):
            self.kafka.check_ports()
            entry = {KAFKA: self._service_spec(KAFKA)}
        self._ask(entry)  # also: a supervisor that is gone is started again for what it left running
        self.kafka.wait_ready(self.kafka.pid(), lambda: self._exit_since(KAFKA, asked_at))
        return bool(entry)

    def _check_ports(self, fresh: list[str]) -> None:
        ports = {"gateway": ("--gateway-port", self.settings.gateway_port),
                 "inference": ("--worker-metrics-port", self.settings.worker_metrics_port)}
        for name in fresh:
            if name in ports and port_open(self.settings.host, ports[name][1]):
                flag, port = ports[name]
                raise PortInUseError(f"port {port} on {self.settings.host} ({name}) is already in use by another "
                                     f"program; stop it or choose another port with {flag}")

    def _wait_healthy(self, wanted, fresh, since: float, on_ready, on_wait,
                      started: Callable[[str], bool] = lambda name: True) -> None:
        """Until each of ``wanted`` is healthy; a service that exits meanwhile (after ``since``, wall
        clock) is an error naming it, with the end of its log. ``started(name)``: the run to wait for
        has begun (a restart: the new process, not the old one still stopping)."""
        began = time.monotonic()
        pending = {name: "starting" for name in wanted}
        while pending:
            for name in list(pending):
                if (reason := self._exit_since(name, since)) is not None:
                    again = ("the supervisor starts it again with backoff: `chatpipe status` shows its restarts, "
                             f"`chatpipe stop {name}` or `chatpipe down` stops it" if name in self.supervised()
                             else "the other services keep running; `chatpipe down` stops them")
                    raise ServiceStartError(f"{happened(name, reason)} while starting ({again}). "
                                            f"Last lines of {self.log_file(name)}:\n{self.log_tail(name)}")
                detail = self._not_ready(name) if started(name) and self._pid(name) is not None else "starting"
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
                    f"`chatpipe status`. Last lines of {self.log_file(name)}:\n{self.log_tail(name)}")
            on_wait(dict(pending), elapsed)
            time.sleep(0.5)

    def down(self, on_stopped: Callable[[StopResult], None] = lambda r: None,
             on_released: Callable[[int | None], None] = lambda pid: None) -> list[StopResult]:
        """Send the supervisor away (nothing is restarted from here on), then stop every service
        (gateway, inference, streams), then Kafka: SIGTERM, SIGKILL after the timeout."""
        on_released(self.supervisor.release())
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
        self.supervisor.forget()
        return results

    # --- one service, through the supervisor -------------------------------------------------
    def _check_supervised(self, names: list[str]) -> None:
        """A named error for a service of ``names`` that the supervisor does not have in hand."""
        if self.settings.brokers > 1 and KAFKA in names:
            raise StackError("a cluster's nodes are not supervised: `chatpipe cluster node restart ID` / "
                             "`chatpipe cluster node stop ID` act on one")
        supervised = self.supervised()
        for name in names:
            if name in supervised:
                continue
            if self.supervisor.spec().get(name) is not None:
                raise StackError(f"the supervisor of {self.settings.state_dir} is not running (see "
                                 f"{self.supervisor.log_file}): `chatpipe up` starts it again, and it takes over "
                                 "what still runs")
            if self._pid(name) is not None:
                raise StackError(f"{name} runs without the supervisor (started by an older chatpipe or outside "
                                 "`chatpipe up`): `chatpipe down`, then `chatpipe up`, puts it under one")
            raise StackError(f"{name} is not started: `chatpipe up --only {name}` starts it")

    def restart(self, names: list[str], *,
                on_ready: Callable[[Health, bool, float], None] = lambda h, started, s: None,
                on_wait: Callable[[dict[str, str], float], None] = lambda pending, s: None) -> None:
        """Stop (SIGTERM) and start again each of ``names`` through the supervisor, which neither counts
        this as a restart nor backs off; wait until each is healthy. A stopped one is started."""
        self._check_supervised(names)
        asked_at = time.time()
        new, _ = self.supervisor.update(lambda spec, runs: spec.restarting(names))
        self.supervisor.wait_applied(new.revision)
        generation = {name: new.get(name).generation for name in names}

        def begun(name: str) -> bool:  # the new run, not the old process still stopping
            record = self._record(name)
            return record is not None and record.state == "running" and record.generation == generation[name]

        self._wait_healthy(names, names, asked_at, on_ready, on_wait, started=begun)

    def stop(self, names: list[str], on_stopped: Callable[[StopResult], None] = lambda r: None) -> list[StopResult]:
        """Stop each of ``names`` through the supervisor and keep it stopped (``restart`` or ``up --only``
        starts it again): SIGTERM, SIGKILL after the stop timeout. The other services keep running."""
        self._check_supervised(names)
        began, asked_at = time.monotonic(), time.time()
        pids = {name: self._pid(name) for name in names}
        new, _ = self.supervisor.update(lambda spec, runs: spec.wanting(names, False))
        self.supervisor.wait_applied(new.revision)
        results = []
        for name in names:
            record = self.supervisor.wait_stopped(name, self.settings.stop_timeout_s + 15)
            last = record.last_exit if record is not None else None
            if pids[name] is None or last is None or last.at < asked_at:
                result = StopResult(name, "not running", None, 0.0)
            else:
                result = StopResult(name, "killed" if last.signal == "SIGKILL" else "stopped", pids[name],
                                    time.monotonic() - began)
            on_stopped(result)
            results.append(result)
        return results
