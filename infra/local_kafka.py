"""The real Apache Kafka broker on one machine: KRaft, combined broker + controller, one node.

Its jars come from Maven Central: ``mvn dependency:copy-dependencies`` on ``infra/kafka/pom.xml``
runs once into a cache folder outside the project (``~/.cache/chatpipe/kafka-<version>/lib``),
then the broker starts as ``java -cp 'lib/*' kafka.Kafka server.properties``. Data, logs and
the pid file live under the state folder (``.chatpipe/kafka`` by default).

With ``kafka_security=sasl_ssl`` (``chatpipe up --kafka-security sasl_ssl``) the client port is a
SASL_SSL listener (SCRAM-SHA-512 over TLS, the certificate and users of ``infra.kafka_security``,
users created at format time), the broker's own inter-broker traffic uses it too (as the admin
user), the controller port is TLS with client certificates (the broker's own), and the
StandardAuthorizer allows the admin user everything and each service what ``service_acls`` gives
it: no port of the broker takes a client that has not authenticated.

Not here: topics (``transport.admin``) and anything the broker does once it runs.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Callable

from infra.kafka_security import ADMIN_USER, BROKER_CERT_PRINCIPAL, MECHANISM, BrokerSecurity, apply_acls
from infra.services import command_line, pid_in, spawn, tail, terminate, write_atomically
from infra.settings import StackSettings
from schemas.errors import ChatpipeError

KAFKA_POM = Path(__file__).parent / "kafka" / "pom.xml"
LOG4J_CONFIG = Path(__file__).parent / "kafka" / "log4j2.properties"


class StackError(ChatpipeError):
    """The local stack cannot do what was asked; the message says why and what to do."""


class PortInUseError(StackError):
    """A port the broker or a service needs is taken by another program."""


class BrokerStartError(StackError):
    """The broker (or a node of a cluster) could not be formatted or did not start."""


def kafka_version() -> str:
    match = re.search(r"<kafka.version>([^<]+)</kafka.version>", KAFKA_POM.read_text())
    if not match:
        raise StackError(f"{KAFKA_POM}: no <kafka.version> property")
    return match[1]


def ensure_jars(settings: StackSettings) -> Path:
    """The broker's classpath folder, assembled by Maven on first use (atomically)."""
    lib = settings.cache_dir / f"kafka-{kafka_version()}" / "lib"
    if (lib / ".complete").exists():
        return lib
    if shutil.which(settings.mvn) is None:
        raise StackError(f"Maven ({settings.mvn!r}) not found: it fetches the Kafka jars from Maven Central. "
                         "Install Maven or set CHATPIPE_MVN.")
    tmp = lib.with_name(f"lib.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cmd = [settings.mvn, "-q", "-B", "-f", str(KAFKA_POM), "dependency:copy-dependencies",
           f"-DoutputDirectory={tmp}", "-DincludeScope=runtime"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
        raise StackError(f"mvn could not fetch the Kafka {kafka_version()} jars:\n{tail}")
    (tmp / ".complete").write_text(kafka_version())
    shutil.rmtree(lib, ignore_errors=True)
    tmp.rename(lib)
    return lib


NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via a proxy


def http_status(url: str) -> int | None:
    """The HTTP status a GET of ``url`` answers (an error status too), None when nothing answers: the
    health probe of the stack's services and backends."""
    try:
        with NO_PROXY.open(url, timeout=2) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, ValueError):
        return None


def port_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """True if something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def kafka_java(java: str, lib: Path, logs_dir: Path, *options: str) -> list[str]:
    """The start of a command line of the Kafka jars in ``lib``: ``java`` with ``options``, logging with our
    log4j2 config under ``logs_dir``; the main class and its arguments follow.

    C1 only (``-XX:TieredStopAtLevel=1``): these JVMs share a few cores with the model. Measured on the
    2-core machine: a broker starts on 2.6 s of CPU instead of 4.3 and idles at 2.3% of a core instead
    of 3.0%; a storage format takes 0.6 s instead of 1.1; 150k records of 512 B produced (acks all) and
    consumed took the same 0.9 s with either JIT, the C1 broker on less CPU (0.5-0.6 s against 0.6-1.0)."""
    return [java, "-XX:TieredStopAtLevel=1", *options, f"-Dkafka.logs.dir={logs_dir}",
            f"-Dlog4j2.configurationFile={LOG4J_CONFIG}", "-cp", f"{lib}/*"]


def new_cluster_id() -> str:
    """A random KRaft cluster id (22 URL-safe base64 characters; it may start with "-")."""
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


def server_properties(header: str, node_id: int, voters: str, listeners: list[str], data_dir: Path, replicas: int,
                      min_isr: int, *extra: str) -> str:
    """``server.properties`` of a combined broker + controller KRaft node (one broker, or a node of a
    cluster): its ``listeners`` lines, internal topics with ``replicas`` copies of which ``min_isr`` must
    have a write, then the ``extra`` lines."""
    return "\n".join([
        header,
        "process.roles=broker,controller",
        f"node.id={node_id}",
        f"controller.quorum.voters={voters}",
        *listeners,
        f"log.dirs={data_dir}",
        # Few internal partitions keep the first consumer group and the first transaction quick on a
        # 2-core machine.
        f"offsets.topic.replication.factor={replicas}",
        "offsets.topic.num.partitions=4",
        f"transaction.state.log.replication.factor={replicas}",
        f"transaction.state.log.min.isr={min_isr}",
        "transaction.state.log.num.partitions=4",
        f"share.coordinator.state.topic.replication.factor={replicas}",
        f"share.coordinator.state.topic.min.isr={min_isr}",
        "group.initial.rebalance.delay.ms=0",
        "num.partitions=1",
        # Topics come from the catalog (`chatpipe topics apply`); a typo should fail, not create.
        "auto.create.topics.enable=false",
        *extra,
        "",
    ])


def plaintext_listeners(host: str, client_port: int, controller_port: int) -> list[str]:
    """``server.properties`` lines of a node with a plaintext client listener and a plaintext controller."""
    return [f"listeners=PLAINTEXT://{host}:{client_port},CONTROLLER://{host}:{controller_port}",
            f"advertised.listeners=PLAINTEXT://{host}:{client_port}",
            "controller.listener.names=CONTROLLER",
            "inter.broker.listener.name=PLAINTEXT",
            "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT"]


class LocalKafka:
    """Start, stop and inspect the single-node broker of one state folder."""

    def __init__(self, settings: StackSettings) -> None:
        self.settings = settings
        self.dir = settings.state_dir.resolve() / "kafka"
        self.pid_file = self.dir / "broker.pid"
        self.logs_dir = self.dir / "logs"
        self.data_dir = self.dir / "data"
        self.stdout_file = self.logs_dir / "broker.out"
        self.killed = False  # the last `down` needed SIGKILL
        self.security = BrokerSecurity(self.dir / "security") if settings.kafka_security == "sasl_ssl" else None

    # --- inspection ------------------------------------------------------------------------
    def pid(self) -> int | None:
        """Pid of this state folder's broker if it is alive (and really is our broker)."""
        pid = pid_in(self.pid_file)  # "<pid>" (LocalKafka.up) or "<pid> <start time>" (the stack's supervisor)
        if pid is None:
            return None
        # A recycled pid belongs to some other program: only trust our own command line.
        cmdline = command_line(pid)
        return pid if "kafka.Kafka" in cmdline and str(self.dir) in cmdline else None

    def running(self) -> bool:
        """The broker's process runs and its client port takes connections."""
        return self.pid() is not None and port_open(self.settings.host, self.settings.kafka_port)

    # --- start -----------------------------------------------------------------------------
    def up(self) -> bool:
        """Start the broker and wait until it answers. Returns False if it was already running."""
        if self.pid() is not None:
            self.wait_ready(self.pid())
            return False
        self.check_ports()
        proc = spawn(self.prepare(), self.stdout_file, cwd=self.dir)  # survives the CLI; `down` stops it
        self.pid_file.write_text(str(proc.pid))
        try:
            self.wait_ready(proc.pid, lambda: None if proc.poll() is None else f"exited with code {proc.returncode}")
        except BrokerStartError:
            if proc.poll() is not None:
                self.pid_file.unlink(missing_ok=True)
            raise
        return True

    def check_ports(self) -> None:
        """Fail at once, naming the port, when another program holds the client or controller port."""
        for port in (self.settings.kafka_port, self.settings.controller_port):
            if port_open(self.settings.host, port):
                raise PortInUseError(
                    f"port {port} on {self.settings.host} is already in use by another program; "
                    "stop it or choose other ports with --kafka-port/--controller-port "
                    "(CHATPIPE_KAFKA_PORT/CHATPIPE_CONTROLLER_PORT)")

    def prepare(self) -> list[str]:
        """Jars, ``server.properties`` and a formatted log dir; returns the broker's command line
        (run it in ``self.dir`` with stdout to ``self.stdout_file``)."""
        lib = ensure_jars(self.settings)
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        formatted = (self.data_dir / "meta.properties").exists()
        if self.security is not None:
            if formatted and not self.security.exists():
                raise BrokerStartError(
                    f"{self.data_dir} was formatted without SCRAM users (a plaintext broker): `chatpipe down`, delete "
                    f"{self.dir} (its topics go with it) and `chatpipe up --kafka-security sasl_ssl` again")
            self.security.ensure((self.settings.host,))
        props = self._write_config()
        if not formatted:
            self._format_storage(lib, props)
        return [*kafka_java(self.settings.java, lib, self.logs_dir, f"-Xmx{self.settings.kafka_heap}", "-Xms128m",
                            "-XX:+UseG1GC", "-Djava.awt.headless=true"), "kafka.Kafka", str(props)]

    def _listener_lines(self) -> list[str]:
        s = self.settings
        if self.security is None:
            return plaintext_listeners(s.host, s.kafka_port, s.controller_port)
        sec = self.security
        return [
            f"listeners=SASL_SSL://{s.host}:{s.kafka_port},CONTROLLER://{s.host}:{s.controller_port}",
            f"advertised.listeners=SASL_SSL://{s.host}:{s.kafka_port}",
            "controller.listener.names=CONTROLLER",
            # The broker talks to itself (transaction markers, ...) over the client listener, as the
            # admin user; to its controller over TLS with its own certificate as client certificate.
            "inter.broker.listener.name=SASL_SSL",
            "listener.security.protocol.map=SASL_SSL:SASL_SSL,CONTROLLER:SSL",
            f"sasl.enabled.mechanisms={MECHANISM}",
            f"sasl.mechanism.inter.broker.protocol={MECHANISM}",
            f"listener.name.sasl_ssl.{MECHANISM.lower()}.sasl.jaas.config="
            f'org.apache.kafka.common.security.scram.ScramLoginModule required username="{ADMIN_USER}" '
            f'password="{sec.password(ADMIN_USER)}";',
            "ssl.keystore.type=PEM",
            f"ssl.keystore.location={sec.keystore}",
            "ssl.truststore.type=PEM",
            f"ssl.truststore.location={sec.ca_file}",
            "listener.name.controller.ssl.client.auth=required",
            "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            # The admin user (the stack's admin client, the broker's inter-broker login) and the
            # broker's certificate (its controller connection) may do anything; the services only
            # what their ACLs allow (infra.kafka_security.service_acls).
            f"super.users=User:{ADMIN_USER};User:{BROKER_CERT_PRINCIPAL}",
            "allow.everyone.if.no.acl.found=false",
        ]

    def _write_config(self) -> Path:
        s = self.settings
        props = self.dir / "server.properties"
        # One node: every internal topic has one replica. Secured, the file holds the admin user's password.
        write_atomically(props, server_properties(
            "# Written by `chatpipe up` on every start; edit StackSettings, not this file.", 1,
            f"1@{s.host}:{s.controller_port}", self._listener_lines(), self.data_dir, 1, 1,
            # Share groups (the inference worker's `--intake share`): a member that dies hands its
            # records back when its session times out; Kafka's 45 s default (and minimum) leaves a
            # crashed worker's prompts unanswered that long. 10 s, heartbeats every 2 s.
            "group.share.min.session.timeout.ms=6000",
            "group.share.session.timeout.ms=10000",
            "group.share.min.heartbeat.interval.ms=1000",
            "group.share.heartbeat.interval.ms=2000",
            # The controller writes a no-op record this often when nothing else happens, and the broker
            # replays it: every 500 ms (the default) that is a quarter of an idle broker's CPU. One
            # node has no other broker whose metadata could lag behind; 5 s: 2.3% of a core -> 1.7%.
            "metadata.max.idle.interval.ms=5000"), 0o600 if self.security is not None else 0o666)
        return props

    def _format_storage(self, lib: Path, props: Path, cluster_id: str | None = None) -> None:
        cluster_id = cluster_id or new_cluster_id()
        proc = subprocess.run(
            [*kafka_java(self.settings.java, lib, self.logs_dir), "kafka.tools.StorageTool", "format",
             # "--opt=value": a base64 id may start with "-", which argparse would take for a flag.
             f"--cluster-id={cluster_id}", f"--config={props}",
             # SCRAM users exist from the first start: the listener has no other way in.
             *(self.security.scram_format_args() if self.security is not None else [])],
            capture_output=True, text=True,
        )
        if proc.returncode != 0:
            output = proc.stdout + proc.stderr
            raise BrokerStartError(f"formatting {self.data_dir} failed:\n"
                                   f"{self.security.scrub(output) if self.security is not None else output}")

    def wait_ready(self, pid: int | None, exited: Callable[[], str | None] = lambda: None) -> None:
        """Wait until the broker answers; ``exited()`` says how it ended once it has ("exited with code 1")."""
        deadline = time.monotonic() + self.settings.start_timeout_s
        while time.monotonic() < deadline:
            if (reason := exited()) is not None:
                said = f"was {reason}" if reason.startswith("killed") else reason
                raise BrokerStartError(
                    f"the Kafka broker {said} while starting. "
                    f"Last lines of {self.logs_dir}:\n{tail(self.stdout_file, 30)}\n{tail(self.logs_dir / 'server.log', 30)}")
            if port_open(self.settings.host, self.settings.kafka_port) and self.answers():
                if self.security is not None:  # before any service connects: without ACLs it may do nothing
                    apply_acls({"bootstrap.servers": self.settings.bootstrap_servers, **self.security.client_config()},
                               self.settings.topic_prefix)
                return
            time.sleep(0.3)
        raise BrokerStartError(
            f"the Kafka broker{f' (pid {pid})' if pid else ''} did not answer on {self.settings.bootstrap_servers} within "
            f"{self.settings.start_timeout_s:.0f}s. Last lines of its log:\n{tail(self.logs_dir / 'server.log', 30)}")

    def answers(self) -> bool:
        """True when the broker answers a metadata request (within about 2 s)."""
        from transport import clients as kafka_clients  # raw: the broker it starts; no client otherwise

        admin = kafka_clients.raw_admin({"bootstrap.servers": self.settings.bootstrap_servers, "log_level": 0,
                             **(self.security.client_config(ADMIN_USER) if self.security is not None else {})})
        try:
            metadata = admin.list_topics(timeout=2)
        except Exception:  # noqa: BLE001 - KafkaException while the broker is still registering
            return False
        return bool(metadata.brokers)

    # --- stop ------------------------------------------------------------------------------
    def down(self) -> bool:
        """Stop the broker (SIGTERM, then SIGKILL after the timeout). False if it was not running."""
        pid = self.pid()
        if pid is not None:  # SIGTERM: the broker's shutdown hook flushes and closes its logs.
            self.killed = terminate(pid, self.settings.stop_timeout_s)
        self.pid_file.unlink(missing_ok=True)
        return pid is not None
