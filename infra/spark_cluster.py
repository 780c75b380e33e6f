"""A Spark standalone cluster on one machine: a master and N workers on loopback.

Each daemon is ``spark-class org.apache.spark.deploy.master.Master`` / ``...worker.Worker`` of
the installed pyspark (its package folder is ``SPARK_HOME``: no separate Spark download), in
its own session so it outlives the CLI. Everything lives under ``<state>/spark``:
``cluster.json`` (ports and pids ``status``/``down`` need), ``master/master.log``,
``worker-<n>/worker.log`` and ``worker-<n>/work`` (the executors' folders with their
``stdout``/``stderr``). Logs are kept by ``down``.

The daemons run with a small, explicit environment: no ``PYTHONPATH``, working folder under the
state folder. So an executor finds the project's code only because the job ships it
(``spark_jobs.shipping``: a zip via ``addPyFile``/``--py-files``), as on a real cluster.

Not here: the Kafka cluster (``infra.kafka_cluster``), building a job's session.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from infra.local_kafka import NO_PROXY, PortInUseError, StackError, port_open
from infra.services import alive, command_line, spawn, tail, write_atomically
from infra.spark_cluster_settings import SparkClusterSettings

STATE_FILE = "cluster.json"
MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"
#: Variables the daemons keep from the caller's environment; anything else (PYTHONPATH above all) is left out.
PASSED_ENV = ("PATH", "HOME", "USER", "LANG", "LC_ALL", "TMPDIR", "JAVA_HOME", "TZ")
#: Files of an executor's folder that ``down`` keeps (its logs); the rest (jars, zips) is removed.
EXECUTOR_LOGS = ("stdout", "stderr")


#: Spark's log line naming the port a service bound (the daemons are asked for port 0: a port
#: picked here could be taken by another program before the JVM binds it).
_BOUND = re.compile(r"Successfully started service '(\w+)' on port (\d+)")


class SparkClusterError(StackError):
    """The Spark cluster cannot be started, or its saved state cannot be used."""


def spark_home() -> Path:
    """The installed pyspark's package folder: Spark's jars, ``bin/spark-class`` and ``bin/spark-submit``."""
    spec = importlib.util.find_spec("pyspark")
    if spec is None or spec.origin is None:
        raise SparkClusterError("pyspark is not installed: pip install 'chatpipe[spark]'")
    return Path(spec.origin).parent


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    worker: int  # 1-based
    pid: int | None
    port: int
    registered: bool  # the master lists it as ALIVE
    cores: int
    cores_used: int
    memory_mb: int
    memory_used_mb: int
    dir: Path


@dataclass(frozen=True, slots=True)
class SparkClusterStatus:
    version: str
    master_url: str | None  # None: no cluster saved in this state folder
    webui_url: str | None
    master_pid: int | None
    master_alive: bool  # the master answers on its web port
    workers: list[WorkerStatus] = field(default_factory=list)
    apps: list[dict] = field(default_factory=list)  # running applications: id, name, cores, memory per executor
    completed_apps: int = 0  # applications that ran on it and ended (since the master started)


class _Daemon:
    """Folder, log and process of one daemon (``master`` or ``worker-<n>``)."""

    def __init__(self, spark_dir: Path, name: str, main_class: str) -> None:
        self.name = name
        self.main_class = main_class
        self.dir = spark_dir / name
        self.log = self.dir / f"{name.split('-')[0]}.log"
        self.tag = f"-Dchatpipe.spark.daemon={self.dir}"  # on the JVM's command line: names this daemon
        self.log_offset = 0  # where the log of the current start begins

    def is_ours(self, pid: int | None) -> bool:
        """``pid`` runs this daemon (pids get recycled: trust only our own command line)."""
        if pid is None or not alive(pid):
            return False
        arguments = command_line(pid).split("\0")
        return self.main_class in arguments and self.tag in arguments

    def start(self, settings: SparkClusterSettings, args: list[str]) -> int:
        env = {
            **{k: os.environ[k] for k in PASSED_ENV if k in os.environ},
            "SPARK_HOME": str(spark_home()),
            "SPARK_DAEMON_MEMORY": settings.spark_daemon_heap,
            "SPARK_DAEMON_JAVA_OPTS": self.tag,
            # No REST submission server: it would take the fixed port 6066.
            "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false",
            "SPARK_LOCAL_IP": settings.host,
            "PYSPARK_PYTHON": str(settings.spark_python),
        }
        self.log_offset = self.log.stat().st_size if self.log.exists() else 0
        # Outlives the CLI; `down` stops its process group. spark-class execs java: the same pid.
        return spawn([str(spark_home() / "bin" / "spark-class"), self.main_class, *args], self.log, env=env,
                     cwd=self.dir).pid

    def bound_port(self, service: str) -> int | None:
        """The port ``service`` (sparkMaster, MasterUI, sparkWorker) bound in this daemon's latest start."""
        try:
            with open(self.log, "rb") as f:
                f.seek(self.log_offset)
                found = [int(port) for name, port in _BOUND.findall(f.read().decode(errors="replace"))
                         if name == service]
        except OSError:
            return None
        return found[-1] if found else None

    def log_tail(self, lines: int = 25) -> str:
        return f"--- {self.log}:\n{tail(self.log, lines)}"


class SparkCluster:
    """Start, stop and inspect the Spark cluster of one state folder."""

    def __init__(self, settings: SparkClusterSettings) -> None:
        self.settings = settings
        self.dir = settings.spark_dir
        self.state_file = self.dir / STATE_FILE
        self.master = _Daemon(self.dir, "master", MASTER_CLASS)
        self.workers = {n: _Daemon(self.dir, f"worker-{n}", WORKER_CLASS) for n in range(1, settings.spark_workers + 1)}

    def _worker(self, n: int) -> _Daemon:
        return self.workers.get(n) or _Daemon(self.dir, f"worker-{n}", WORKER_CLASS)

    # --- saved state ----------------------------------------------------------------------
    def _load(self) -> dict | None:
        if not self.state_file.exists():
            return None
        try:
            state = json.loads(self.state_file.read_text())
            for key in ("master_port", "webui_port"):  # None: the master was still starting
                state[key] = None if state[key] is None else int(state[key])
            state["workers"] = {int(k): dict(v) for k, v in state["workers"].items()}
            return state
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise SparkClusterError(f"{self.state_file} cannot be read ({exc}); stop any Spark daemons it named "
                                    "and delete it") from None

    def _save(self, state: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        write_atomically(self.state_file, json.dumps(state, indent=2) + "\n")

    def master_url(self) -> str | None:
        """``spark://host:port`` of this state folder's running master, else None."""
        state = self._load()
        if state is None or not self.master.is_ours(state.get("master_pid")) or state["master_port"] is None:
            return None
        return f"spark://{state['host']}:{state['master_port']}"

    # --- the master's JSON ------------------------------------------------------------------
    def _json(self, state: dict) -> dict | None:
        try:
            with NO_PROXY.open(f"http://{state['host']}:{state['webui_port']}/json/", timeout=2.0) as resp:
                return json.loads(resp.read())
        except (OSError, ValueError):  # URLError is an OSError
            return None

    # --- start ----------------------------------------------------------------------------
    def up(self) -> list[str]:
        """Start what is not running (master, workers) and wait until every worker is registered.

        Returns the daemons started (empty when the whole cluster was already up).
        """
        state = self._load()
        started: list[str] = []
        if state is None or not self.master.is_ours(state.get("master_pid")) or state["webui_port"] is None:
            state = self._start_master()
            started.append("master")
        for n, worker in self.workers.items():
            if not worker.is_ours(state["workers"].get(n, {}).get("pid")):
                pid = worker.start(self.settings, [
                    "--host", self.settings.host, "--port", "0", "--webui-port", "0",
                    "--cores", str(self.settings.spark_worker_cores), "--memory", self.settings.spark_worker_memory,
                    "--work-dir", str(worker.dir / "work"), f"spark://{state['host']}:{state['master_port']}"])
                state["workers"][n] = {"pid": pid, "port": None}
                self._save(state)
                started.append(worker.name)
        try:
            self._wait_registered(state)
        except SparkClusterError:
            if started:
                self.down()  # nothing half-started left behind; the logs stay
            raise
        return started

    def _start_master(self) -> dict:
        s = self.settings
        for port in (s.spark_master_port, s.spark_webui_port):
            if port and port_open(s.host, port):
                raise PortInUseError(f"port {port} on {s.host} is already in use by another program; choose "
                                     "other ports (--port / --webui-port, CHATPIPE_SPARK_MASTER_PORT / _WEBUI_PORT) "
                                     "or leave them at 0 (free ports)")
        self.down()  # a master that died, or one still starting: stop what is left first
        pid = self.master.start(s, ["--host", s.host, "--port", str(s.spark_master_port),
                                    "--webui-port", str(s.spark_webui_port)])
        state = {"host": s.host, "master_port": None, "webui_port": None, "master_pid": pid,
                 "spark_home": str(spark_home()), "workers": {}}
        self._save(state)  # `down` can stop it even if it never comes up
        deadline = time.monotonic() + s.spark_start_timeout_s
        while (rpc := self.master.bound_port("sparkMaster")) is None or (web := self.master.bound_port("MasterUI")) is None:
            if not alive(pid):
                self.down()
                raise SparkClusterError(f"the Spark master exited while starting.\n{self.master.log_tail()}")
            if time.monotonic() > deadline:
                self.down()
                raise SparkClusterError(f"the Spark master did not start within {s.spark_start_timeout_s:.0f}s."
                                        f"\n{self.master.log_tail()}")
            time.sleep(0.2)
        state.update(master_port=rpc, webui_port=web)
        self._save(state)
        return state

    def _wait_registered(self, state: dict) -> None:
        deadline = time.monotonic() + self.settings.spark_start_timeout_s
        while True:
            daemons = [(self.master, state["master_pid"])] + [
                (w, state["workers"][n]["pid"]) for n, w in self.workers.items()]
            for daemon, pid in daemons:
                if not alive(pid):  # just started by us (spark-class may not have exec'd java yet)
                    raise SparkClusterError(f"the Spark {daemon.name} exited while starting.\n{daemon.log_tail()}")
            for n, worker in self.workers.items():
                if state["workers"][n]["port"] is None and (port := worker.bound_port("sparkWorker")) is not None:
                    state["workers"][n]["port"] = port
                    self._save(state)
            doc = self._json(state)
            if doc is not None:
                alive_ports = {w.get("port") for w in doc.get("workers", []) if w.get("state") == "ALIVE"}
                if all(state["workers"][n]["port"] in alive_ports for n in self.workers):
                    return
            if time.monotonic() > deadline:
                tails = "\n".join(d.log_tail(10) for d, _ in daemons)
                raise SparkClusterError(f"the Spark workers did not register with the master within "
                                        f"{self.settings.spark_start_timeout_s:.0f}s.\n{tails}")
            time.sleep(0.5)

    # --- stop -----------------------------------------------------------------------------
    def down(self) -> list[str]:
        """SIGTERM every daemon (and its executors: the process group), SIGKILL after the stop
        timeout; remove the saved state and the executors' copies of jars and code (logs stay)."""
        state = self._load()
        if state is None:
            return []
        daemons = [(self.master, state.get("master_pid"))] + [
            (self._worker(n), saved.get("pid")) for n, saved in sorted(state["workers"].items())]
        running = [(d, pid) for d, pid in daemons if d.is_ours(pid)]
        for _, pid in running:
            _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.settings.stop_timeout_s
        while time.monotonic() < deadline and any(d.is_ours(pid) for d, pid in running):
            time.sleep(0.2)
        for d, pid in running:
            if d.is_ours(pid):
                _signal_group(pid, signal.SIGKILL)
        self.state_file.unlink(missing_ok=True)
        for n in sorted(set(self.workers) | set(state["workers"])):
            _clean_work_dir(self._worker(n).dir / "work")
        return [d.name for d, _ in running]

    # --- inspection -----------------------------------------------------------------------
    def status(self) -> SparkClusterStatus:
        version = importlib.metadata.version("pyspark")
        state = self._load()
        if state is None:
            return SparkClusterStatus(version, None, None, None, False)
        master_pid = state.get("master_pid") if self.master.is_ours(state.get("master_pid")) else None
        doc = self._json(state) if master_pid is not None else None
        listed = {w.get("port"): w for w in (doc or {}).get("workers", []) if w.get("state") == "ALIVE"}
        workers = []
        for n, saved in sorted(state["workers"].items()):  # as started (a later --workers does not matter)
            w = self._worker(n)
            info = listed.get(saved.get("port"), {})
            workers.append(WorkerStatus(n, saved.get("pid") if w.is_ours(saved.get("pid")) else None,
                                        saved.get("port", 0), bool(info), info.get("cores", 0),
                                        info.get("coresused", 0), info.get("memory", 0), info.get("memoryused", 0),
                                        w.dir))
        apps = [{"id": a.get("id"), "name": a.get("name"), "cores": a.get("cores"),
                 "memory_per_executor_mb": a.get("memoryperexecutor", a.get("memoryperslave")),
                 "state": a.get("state")} for a in (doc or {}).get("activeapps", [])]
        return SparkClusterStatus(version, f"spark://{state['host']}:{state['master_port']}",
                                  f"http://{state['host']}:{state['webui_port']}", master_pid, doc is not None,
                                  workers, apps, len((doc or {}).get("completedapps", [])))


def _signal_group(pid: int, sig: signal.Signals) -> None:
    """Signal the daemon's process group (it leads its own session: the group holds it, its
    executors and their Python workers, nothing else)."""
    with suppress(ProcessLookupError):
        os.killpg(pid, sig)


def _clean_work_dir(work: Path) -> None:
    """Keep each executor's stdout/stderr; remove the jars and code copies Spark fetched into it."""
    for item in work.glob("*/*/*"):  # <app>/<executor>/<item>
        if item.name in EXECUTOR_LOGS:
            continue
        if item.is_dir():
            shutil.rmtree(item, ignore_errors=True)
        else:
            item.unlink(missing_ok=True)
