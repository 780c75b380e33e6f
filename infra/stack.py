"""The whole local stack of one state folder: Kafka, Redis, the streams workers, the inference workers, the gateway.

``LocalStack.up`` asks the stack's supervisor (``infra.supervisor``, a detached ``chatpipe supervise``)
to run what is not running (Kafka first, then the three services side by side, each a ``chatpipe
<cmd>`` process with its log under ``<state>/logs``; Redis, and Jaeger and Prometheus with observability,
between Kafka and them) and waits until every one is healthy; the
supervisor starts again any that exits, with backoff. ``down`` sends the supervisor away first (so
nothing is restarted), then stops the services in reverse dependency order; ``restart`` and ``stop``
act on one service through the supervisor; ``status`` probes each and adds its restarts and last exit.

Streams and inference scale: ``streams_workers`` / ``inference_workers`` instances, named ``streams``,
``streams-2``, ... (``infra.instances``), each a service of its own (pid file, log, restarts), all of a
kind in one consumer group. ``up`` with a smaller count stops the surplus, with a larger one starts
the extra ones.

Health, per service (``probe``):
- kafka: its process runs and the broker answers a metadata request;
- redis (the streams workers' response cache, ``response_cache`` on; ``infra.redis_server``): a ``PING``
  is answered ``+PONG``;
- streams (each instance): its process runs and its Faust consumer group has at least as many members
  as streams workers run (every one has joined; the group splits the partitions between them);
- inference (each instance): its process runs, its ``/metrics`` answers (the model is loaded) and its
  consumer group has at least as many members as inference workers run;
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
import signal
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from infra import redis_server, stack_state
from infra.instances import (INFERENCE, STREAMS, found_instances, instance_dir, instance_env, instance_names,
                             kind_of, metrics_port, parse_instance, streams_metrics_port)
from infra.kafka_security import ADMIN_USER, MECHANISM, PROTOCOL, SERVICE_USERS
from infra.local_kafka import LocalKafka, PortInUseError, StackError, http_status, port_open
from infra.local_keys import ensure_keys_file
from infra.observability import backends, binaries
from infra.observability.backends import BACKENDS, JAEGER, PROMETHEUS
from infra.redis_server import REDIS
from infra.services import ServiceProcess, StopResult, tail
from infra.settings import StackSettings
from infra.supervision import (ExitRecord, ServiceSpec, ServiceState, Spec, SupervisorClient, SupervisorState,
                               happened)

KAFKA = "kafka"
SERVICES = ("streams", "inference", "gateway")  # kinds started after Kafka; stopped before it, in reverse
# The kinds (`--only` takes these; redis with the response cache, jaeger and prometheus with
# --observability); names: `service_names`
ALL = (KAFKA, REDIS, *SERVICES, *BACKENDS)
# Kinds a setting turns on or off (observability, response_cache): one found running while its setting
# is off is a surplus that `up` stops, like a worker beyond the count.
OPTIONAL = (*BACKENDS, REDIS)

# The groups the services join with their default settings (streams: the Faust app id;
# inference: the worker's consumer group). Literal here so `up` does not import either service.
STREAMS_GROUP = "chatpipe-streams"
INFERENCE_GROUP = "chatpipe-inference"


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


def service_names(settings: StackSettings) -> tuple[str, ...]:
    """Every service of a stack in start order: kafka, (jaeger, prometheus with observability), (redis with
    the response cache), streams, streams-2, ..., inference, inference-2, ..., gateway (stopped in reverse:
    the trace store after the services that send it spans, Redis after the streams workers that use it)."""
    return (KAFKA, *(BACKENDS if settings.observability else ()), *((REDIS,) if settings.response_cache else ()),
            *instance_names(STREAMS, settings.streams_workers),
            *instance_names(INFERENCE, settings.inference_workers), "gateway")


def broker_for(settings: StackSettings):
    """The Kafka of this stack: one broker (``LocalKafka``), or a KRaft cluster for ``brokers`` > 1.

    ``LocalStack`` uses of it: ``up()`` (false: was running), ``down()`` (false: was not running),
    ``killed`` (the last down needed SIGKILL), ``pid()`` (of the first node that runs), ``running()``,
    ``answers()``, ``logs_dir``; and ``LocalStack.bootstrap_servers`` for the clients.
    """
    if settings.brokers > 1:
        from infra.cluster_broker import ClusterBroker

        if settings.kafka_security != "plaintext":  # flags are checked by StackSettings; this is flags + stack.json
            raise StackError(f"--kafka-security {settings.kafka_security} secures the one-broker stack only, not a "
                             f"{settings.brokers}-node cluster; use --brokers 1")
        return ClusterBroker(settings)
    return LocalKafka(settings)


def _rank(name: str) -> tuple[str, int]:
    """Sort key of service names found beyond a stack's own: "streams-2" -> ("streams", 2), "jaeger" -> ("jaeger", 0)."""
    return parse_instance(name) or (name, 0)


class LocalStack:
    def __init__(self, settings: StackSettings, services: list[str] | None = None) -> None:
        self.settings = settings
        self.kafka = broker_for(settings)
        self.names = service_names(settings)
        self.supervisor = SupervisorClient(settings)
        # Services this stack was started with (`up --only kafka`: Kafka alone); None = all.
        self.services = list(self.names) if services is None else [s for s in self.names if s in services]
        self._admin = None

    @classmethod
    def open(cls, settings: StackSettings) -> "LocalStack":
        """The stack of ``settings.state_dir`` with what was saved there merged in (``stack_state``)."""
        probe = cls(settings)
        merged, services = stack_state.resolve(settings, running=probe.running_services())
        return cls(merged, services)

    def running_services(self) -> set[str]:
        """The services of this state folder whose process runs (ports are not needed to tell), instances
        beyond the stack's counts included."""
        return {name for name in self._known() if self._pid(name) is not None}

    def _known(self) -> list[str]:
        """The stack's services, then instances beyond its counts that have a pid file (an earlier `up`
        with a larger count, a stack whose stack.json is gone)."""
        extra = found_instances(self.settings.run_dir) - set(self.names)
        extra |= {b for b in OPTIONAL if (self.settings.run_dir / f"{b}.pid").exists()} - set(self.names)
        return [*self.names, *sorted(extra, key=_rank)]

    def _process(self, name: str) -> ServiceProcess:
        return ServiceProcess(name, self.settings)  # its pid file and log, by name

    def _pid(self, name: str) -> int | None:
        return self.kafka.pid() if name == KAFKA else self._process(name).pid()

    @property
    def bootstrap_servers(self) -> str:
        """What the services and the admin client connect to (every node of a cluster)."""
        return getattr(self.kafka, "bootstrap_servers", self.settings.bootstrap_servers)

    # --- what each service is started with ---------------------------------------------------
    def command(self, name: str) -> list[str]:
        s = self.settings
        kafka = ["--bootstrap-servers", self.bootstrap_servers] + (["--topic-prefix", s.topic_prefix] if s.topic_prefix else [])
        state = s.state_dir.resolve()
        kind, index = parse_instance(name) or (name, 1)
        if kind == STREAMS:
            # Faust's data folder is the instance's own; the archive is shared (a partition's files are
            # written by the one worker that owns it), and so is the Qdrant server (more than one
            # worker needs one: `_check_scale`).
            memory = ["--qdrant-url", s.qdrant_url] if s.qdrant_url else ["--memory-path", str(state / "qdrant")]
            # The response cache: every worker the one Redis of the stack (a prompt answered by one worker
            # is a hit for all); none without the cache.
            cache = ["--cache-url", redis_server.url(s)] if s.response_cache else []
            return ["streams", *kafka, "--state-dir", str(instance_dir(s, name)), "--archive-dir",
                    str(state / "archive"), *memory, *cache, "--metrics-port", str(streams_metrics_port(s, index))]
        if kind == INFERENCE:
            # Partition intake (a consumer group) always: its members are how `up` sees the worker
            # serving; a share group is not listed by the admin API (run `chatpipe inference
            # --intake share` by hand for that).
            return ["inference", *kafka, "--engine", s.inference_engine, "--intake", "partition", "--metrics-port",
                    str(metrics_port(s, index))]
        if name == "gateway":
            return ["gateway", *kafka, "--host", s.host, "--port", str(s.gateway_port), "--keys-file", str(s.keys_file)]
        raise ValueError(f"no service {name!r}")

    def service_env(self, name: str) -> dict[str, str]:
        """Variables every service gets besides those of the `chatpipe up` that starts it: on a
        cluster, the topics they create themselves (Faust's changelog, the gateway's reply topic)
        are replicated like the catalog's; on a secured broker (``--kafka-security sasl_ssl``),
        service ``name`` logs in as its own user (``CHATPIPE_KAFKA_*``, infra.kafka_security)."""
        env = {"CHATPIPE_REPLICATION_FACTOR": "3"} if self.settings.brokers >= 3 else {}
        # Spans (transport.spans): always as OTLP JSON lines under <state>/traces, and to Jaeger's OTLP/HTTP
        # receiver when observability is on; a value set for `up` wins.
        tracing = {"CHATPIPE_TRACING_FILE_DIR": str(self.settings.state_dir.resolve() / "traces")}
        if self.settings.observability:
            tracing["CHATPIPE_TRACING_OTLP_ENDPOINT"] = backends.otlp_endpoint(self.settings)
        # A child's environment: _service_spec starts every service with os.environ, whose own value is kept.
        env.update({k: v for k, v in tracing.items() if k not in os.environ})
        if kind_of(name) in SERVICE_USERS and self.broker_security is not None:  # Redis, Jaeger: no Kafka client
            env.update(self.broker_security.client_env(SERVICE_USERS[kind_of(name)]))
        return env

    @property
    def broker_security(self):
        """The secured broker's CA and users (``infra.kafka_security.BrokerSecurity``); None for plaintext."""
        return getattr(self.kafka, "security", None)

    def _service_spec(self, name: str) -> ServiceSpec:
        """What the supervisor runs for ``name``, with the environment of this process (``up``'s), less
        what each instance needs of its own (``instance_env``: a port, a worker id)."""
        env = {**os.environ, **self.service_env(name), **instance_env(name, os.environ)}
        if name == KAFKA:
            k = self.kafka
            return ServiceSpec(KAFKA, tuple(k.prepare()), env, str(k.stdout_file), str(k.pid_file), cwd=str(k.dir),
                               tail_file=str(k.logs_dir / "server.log"))
        proc = self._process(name)
        if name in BACKENDS:
            argv, cwd = backends.command(self.settings, name, binaries.installed(self.settings))
            return ServiceSpec(name, tuple(argv), env, str(proc.log_file), str(proc.pid_file), cwd=str(cwd))
        if name == REDIS:
            argv, cwd = redis_server.command(self.settings, redis_server.executable(self.settings))
            return ServiceSpec(name, tuple(argv), env, str(proc.log_file), str(proc.pid_file), cwd=str(cwd))
        return ServiceSpec(name, (sys.executable, "-m", "chatpipe.cli", *self.command(name)), env,
                           str(proc.log_file), str(proc.pid_file))

    def address(self, name: str) -> str:
        s = self.settings
        kafka = (f"{self.bootstrap_servers} ({s.brokers} nodes)" if s.brokers > 1
                 else f"{self.bootstrap_servers} (controller :{s.controller_port})")
        if self.broker_security is not None:  # who logs in how; the passwords stay in <state>/kafka/security
            kafka += f", {PROTOCOL} {MECHANISM} (admin user {ADMIN_USER}, CA {self.broker_security.ca_file})"
        kind, index = parse_instance(name) or (name, 1)
        if kind in BACKENDS:
            return backends.address(s, kind, self._installed())
        if kind == REDIS:
            return redis_server.address(s)
        return {KAFKA: kafka,
                STREAMS: f"http://{s.host}:{streams_metrics_port(s, index)}/metrics, group {s.topic_prefix}{STREAMS_GROUP}"
                         + (f", qdrant {s.qdrant_url}" if s.qdrant_url else ""),
                INFERENCE: f"http://{s.host}:{metrics_port(s, index)}/metrics",
                "gateway": s.gateway_url}[kind]

    def log_file(self, name: str) -> Path:
        return self.kafka.logs_dir / "server.log" if name == KAFKA else self._process(name).log_file

    def log_tail(self, name: str, lines: int = 20) -> str:
        if name == KAFKA:
            return f"{tail(self.kafka.logs_dir / 'broker.out', lines)}\n{tail(self.log_file(KAFKA), lines)}"
        return tail(self.log_file(name), lines)

    # --- the supervisor ----------------------------------------------------------------------
    def supervised(self) -> dict[str, ServiceSpec]:
        """The services the running supervisor has in hand (wanted or held stopped); {} if none runs."""
        if self.supervisor.pid() is None:
            return {}
        return {service.name: service for service in self.supervisor.spec().services}

    def _ask(self, entries: dict[str, ServiceSpec], drop: frozenset[str] = frozenset()) -> None:
        """Hand ``entries`` to the supervisor (starting one if needed), forget ``drop`` (stopped
        instances beyond the stack's counts), and wait until it has acted."""

        def change(spec: Spec, supervisor_runs: bool) -> Spec:
            if not supervisor_runs:  # left by a supervisor that is gone: what still runs is adopted, the rest forgotten
                spec = spec.without({s.name for s in spec.services if not (s.wanted and self._pid(s.name) is not None)})
            spec = spec.without(set(drop))
            for name, entry in entries.items():
                old = spec.get(name)
                spec = spec.put(replace(entry, generation=old.generation if old else 0), self.names)
            return spec

        new, _ = self.supervisor.update(change)
        if any(s.wanted for s in new.services):
            self.supervisor.wait_applied(new.revision)

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

            login = self.broker_security.settings_fields(ADMIN_USER) if self.broker_security is not None else {}
            self._admin = TopicAdmin(KafkaSettings(bootstrap_servers=self.bootstrap_servers,
                                                   topic_prefix=self.settings.topic_prefix, **login), timeout_s=5.0)
        return self._admin

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

    def _group_short(self, kind: str, group: str, joining: str) -> str:
        """"" when ``group`` has at least as many members as instances of ``kind`` run (each has joined;
        a worker that died stays a member until its session times out, so this is a floor), else why not."""
        from transport.errors import TransportError

        running = sum(1 for n in self._known() if kind_of(n) == kind and self._pid(n) is not None)
        try:
            members = self.admin().group_members(f"{self.settings.topic_prefix}{group}")
        except TransportError:
            members = 0
        if members >= max(1, running):
            return ""
        return joining if members == 0 else f"{members} of {running} {kind} workers in its consumer group"

    def _not_ready(self, name: str) -> str:
        """Why the running service ``name`` is not healthy yet ("" when it is)."""
        s = self.settings
        kind, index = parse_instance(name) or (name, 1)
        if kind == KAFKA:
            return "" if self.kafka.running() and self.kafka.answers() else "the broker does not answer"
        if kind in (STREAMS, INFERENCE) and self.kafka.pid() is None:
            return "Kafka is not running"  # no group to ask about (and no 5 s admin timeout per probe)
        if kind in BACKENDS:
            return backends.not_ready(s, kind)
        if kind == REDIS:
            return redis_server.not_ready(s)
        if kind == "gateway":
            code = http_status(f"{s.gateway_url}/healthz")
            return "" if code == 200 else f"/healthz answers {code or 'nothing'}"
        if kind == INFERENCE:
            if http_status(f"http://{s.host}:{metrics_port(s, index)}/metrics") != 200:
                return "loading the model (/metrics not up yet)"
            return self._group_short(INFERENCE, INFERENCE_GROUP, "joining its consumer group")
        if kind == STREAMS:
            return self._group_short(STREAMS, STREAMS_GROUP, "loading models / joining its consumer group")
        raise ValueError(f"no service {name!r}")

    def status(self) -> list[Health]:
        """Every service of the stack, and any instance beyond its counts that still runs."""
        return [self.probe(name) for name in self._known() if name in self.names or self._pid(name) is not None]

    # --- up / down ---------------------------------------------------------------------------
    def up(self, only: list[str] | None = None, *,
           on_ready: Callable[[Health, bool, float], None] = lambda h, started, s: None,
           on_topics: Callable[[list], None] = lambda changes: None,
           on_wait: Callable[[dict[str, str], float], None] = lambda pending, s: None,
           on_stopped: Callable[[StopResult], None] = lambda r: None,
           on_build: Callable[[str], None] = lambda message: None) -> None:
        """Start Kafka (and apply the topic catalog) and the ``only`` kinds of service (all by default:
        every instance of each) that do not run, under the supervisor; wait until each is healthy.
        Instances beyond the counts (an earlier ``up`` had more) are stopped first. With observability,
        Jaeger and Prometheus are built first if they are not (``on_build(message)`` says what is built).

        With the response cache, Redis is started with the streams workers (``only`` naming streams
        includes it); a missing ``redis-server`` is one line before anything starts.

        ``on_ready(health, started_now, seconds)`` once per service; ``on_topics(changes)`` after the
        catalog is applied; ``on_wait({name: why}, seconds)`` while some are not healthy yet;
        ``on_stopped(result)`` per surplus instance stopped.
        """
        backend_kinds = BACKENDS if self.settings.observability else ()
        cache_kinds = (REDIS,) if self.settings.response_cache else ()
        kinds = [k for k in (*backend_kinds, *cache_kinds, *SERVICES)
                 if only is None or k in only or (k == REDIS and STREAMS in only)]  # the workers' cache with them
        self._check_scale(kinds)
        if only is not None and not self.settings.observability and set(only) & set(BACKENDS):
            raise StackError(f"--only {','.join(only)}: jaeger and prometheus run with --observability only")
        if only is not None and not self.settings.response_cache and REDIS in only:
            raise StackError(f"--only {','.join(only)}: redis runs with the response cache only (drop "
                             "--no-response-cache)")
        wanted = [n for n in self.names if n != KAFKA and kind_of(n) in kinds]
        self._prepare_backends(wanted, on_build)
        self._prepare_redis(wanted)
        began, asked_at = time.monotonic(), time.time()
        started = self._up_kafka(asked_at)
        surplus = self._surplus()
        self._retire(surplus, on_stopped)
        supervised = self.supervised()
        self.services = [KAFKA, *[n for n in self.names if n != KAFKA and (
            n in wanted or n in supervised or self._pid(n) is not None)]]
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
        if entries or surplus:
            self._ask(entries, drop=frozenset(surplus))
        self._wait_healthy(wanted, fresh, asked_at, on_ready, on_wait)

    def _installed(self) -> binaries.Installed | None:
        try:
            return binaries.installed(self.settings)
        except binaries.BuildError:
            return None

    def _prepare_backends(self, wanted: list[str], on_build: Callable[[str], None]) -> None:
        """Build Jaeger and Prometheus if they are not (before anything starts: a missing Go is one line),
        and write their configs. Prometheus's is written at every ``up`` (another worker count changes its
        targets); a running Prometheus reloads it on SIGHUP."""
        if not self.settings.observability:
            return
        fresh = [n for n in wanted if n in BACKENDS and self._pid(n) is None]
        installed = binaries.ensure(self.settings, on_build) if fresh else self._installed()
        if JAEGER in fresh:
            backends.write_config(self.settings, JAEGER, installed)
        pid = self._pid(PROMETHEUS)
        if backends.write_config(self.settings, PROMETHEUS) and pid is not None:
            os.kill(pid, signal.SIGHUP)

    def _prepare_redis(self, wanted: list[str]) -> None:
        """Before anything starts: ``redis-server`` is there (else one line saying what to install), and
        its folder."""
        if REDIS in wanted and self._pid(REDIS) is None:
            redis_server.executable(self.settings)
            redis_server.folder(self.settings).mkdir(parents=True, exist_ok=True)

    def _check_scale(self, kinds: list[str]) -> None:
        """One line for worker counts that cannot work: several streams workers on Qdrant local mode (a
        folder one process opens), the workers' /metrics ports (inference and streams) out of range or on
        another service's port."""
        s = self.settings
        if STREAMS in kinds:
            if s.streams_workers > 1 and not s.qdrant_url:
                raise StackError(f"--streams-workers {s.streams_workers} needs a Qdrant server: give --qdrant-url URL "
                                 "(e.g. ../shared/tools/qdrant); Qdrant local mode is a folder only one process can open")
            inference_ports = {metrics_port(s, i): "an inference worker's /metrics port (--worker-metrics-port)"
                               for i in range(1, s.inference_workers + 1)}
            self._check_worker_ports("a streams", "--streams-workers", s.streams_workers, streams_metrics_port,
                                     "--streams-metrics-port", inference_ports)
        if INFERENCE in kinds:
            self._check_worker_ports("an inference", "--inference-workers", s.inference_workers, metrics_port,
                                     "--worker-metrics-port")

    def _check_worker_ports(self, worker: str, count_flag: str, count: int, port_of: Callable[[StackSettings, int], int],
                            port_flag: str, also_taken: dict[int, str] | None = None) -> None:
        """The /metrics ports of ``count`` workers (worker n's: ``port_of(settings, n)``): in range, and
        none of another service's ports (``also_taken``: port -> whose, besides the gateway's and Kafka's)."""
        s = self.settings
        first, last = port_of(s, 1), port_of(s, count)
        if last > 65535:
            raise StackError(f"{count_flag} {count} from {port_flag} {first} needs ports up to {last}, past 65535; "
                             f"choose a lower {port_flag}")
        taken = {s.gateway_port: "the gateway's (--gateway-port)", **(also_taken or {})}
        if s.response_cache:
            taken[s.redis_port] = "Redis's (--redis-port)"
        if s.brokers == 1:
            taken |= {s.kafka_port: "Kafka's (--kafka-port)", s.controller_port: "the controller's (--controller-port)"}
        for port, whose in taken.items():
            if first <= port <= last:
                raise StackError(f"port {port} is {whose} and also {worker} worker's /metrics port (worker n listens "
                                 f"on {port_flag} + n - 1: {first}-{last}); choose other ports")

    def _surplus(self) -> list[str]:
        """Instances beyond the stack's counts that run or that the supervisor has in hand, highest first."""
        held = {s.name for s in self.supervisor.spec().services}
        extra = [n for n in self._known() if n not in self.names and self._pid(n) is not None]
        extra += [n for n in held if (parse_instance(n) is not None or n in OPTIONAL) and n not in self.names
                  and n not in extra]
        return sorted(extra, key=_rank, reverse=True)

    def _retire(self, names: list[str], on_stopped: Callable[[StopResult], None]) -> None:
        """Stop ``names`` (surplus instances): through the supervisor those it has in hand, the others
        directly; the caller then drops them from the spec (``_ask(drop=...)``)."""
        supervised = self.supervised()
        held = [n for n in names if n in supervised]
        if held:
            self.stop(held, on_stopped)
        for name in names:
            if name not in held:
                on_stopped(self._process(name).stop(self.settings.stop_timeout_s))

    def _up_kafka(self, asked_at: float) -> bool:
        """Kafka up and answering; True if this call started it."""
        if self.settings.brokers > 1:
            return bool(self.kafka.up())  # a cluster's nodes are not supervised (`chatpipe cluster node ...`)
        supervised = self.supervised()
        entry = {}
        if self.kafka.pid() is None and not (KAFKA in supervised and supervised[KAFKA].wanted):
            self.kafka.check_ports()
            entry = {KAFKA: self._service_spec(KAFKA)}
        self._ask(entry)  # also: a supervisor that is gone is started again for what it left running
        self.kafka.wait_ready(self.kafka.pid(), lambda: self._exit_since(KAFKA, asked_at))
        return bool(entry)

    def _check_ports(self, fresh: list[str]) -> None:
        s = self.settings
        for name in fresh:
            kind, index = parse_instance(name) or (name, 1)
            if kind in BACKENDS:
                ports = backends.ports(s, kind)  # port -> the setting that chooses it
            elif kind == REDIS:
                ports = redis_server.ports(s)
            elif kind == "gateway":
                ports = {s.gateway_port: "--gateway-port"}
            else:  # an inference or a streams worker
                flag, port_of = (("--worker-metrics-port", metrics_port) if kind == INFERENCE
                                 else ("--streams-metrics-port", streams_metrics_port))
                hint = f" ({kind} worker n listens on it + n - 1)" if index > 1 else ""
                ports = {port_of(s, index): flag + hint}
            for port, flag in ports.items():
                if port_open(s.host, port):
                    raise PortInUseError(f"port {port} on {s.host} ({name}) is already in use by another "
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
        (gateway, the inference workers, the streams workers: each instance, the last first; then Redis and
        the observability backends), then Kafka:
        SIGTERM, SIGKILL after the timeout."""
        on_released(self.supervisor.release())
        results = []
        for name in reversed(self._known()):
            if name == KAFKA:
                continue
            result = self._process(name).stop(self.settings.stop_timeout_s)
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
            raise StackError(f"{name} is not started: `chatpipe up --only {kind_of(name)}` starts it")

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
