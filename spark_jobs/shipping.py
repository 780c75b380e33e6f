"""How a job's code and connector jars reach a cluster's executors, and the spark-submit form.

On ``local[*]`` everything runs in this process's JVM and Python, so nothing has to travel.
On a cluster the executors are other processes (other machines) that have neither the
project's Python packages nor the connector jars:

- jars: ``spark.jars`` (``session.session_conf``), or ``--jars`` under spark-submit;
- Python: a zip of the packages the jobs' code may import on an executor
  (``PROJECT_PACKAGES``), added with ``SparkContext.addPyFile`` by the job's session (also
  under spark-submit, so no ``--py-files`` is needed); Spark puts it on every Python worker's
  ``sys.path``, and its name on their ``PYTHONPATH`` for the processes a worker starts (the
  training processes). Built once per content into the jars cache;
- the Python executable of executors: ``spark.pyspark.python`` (default: this interpreter).
  pyspark applies that setting itself only to a driver that spark-submit starts, so a driver
  started as ``chatpipe job`` sets it on its SparkContext.

``spark-submit`` starts the driver's JVM before the job's code runs, so a jar not given on its
command line can no longer reach the driver: :func:`check_submitted` stops such a run at once
with one line naming the ``--jars`` to add; :func:`submit_command` builds the full command
(``chatpipe spark submit``). Not here: fetching the jars (``jars.py``), the session's
settings (``session.py``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shlex
import sys
import zipfile
from pathlib import Path

from spark_jobs.errors import SparkJobError

#: Packages an executor may import: the jobs and what they import (schemas, transport); training and formats for
#: the training processes that TorchDistributor starts as barrier tasks on a cluster (`chatpipe train lora --master`).
PROJECT_PACKAGES = ("spark_jobs", "training", "schemas", "transport", "formats")
#: ``chatpipe spark submit`` job names -> module run by spark-submit.
JOB_MODULES = {"finetune-dataset": "spark_jobs.finetune_dataset", "usage-report": "spark_jobs.usage_report"}
#: A class of each connector: present in the driver's JVM only if its jar was on spark-submit's classpath.
CONNECTOR_CLASSES = ("org.apache.spark.sql.avro.AvroDataToCatalyst", "org.apache.spark.sql.kafka010.KafkaSourceProvider")


class SubmitError(SparkJobError):
    """The job was started by spark-submit without what it needs (connector jars)."""


def is_local(master: str) -> bool:
    return master.startswith("local")


def _package_files() -> list[tuple[str, Path]]:
    files = []
    for package in PROJECT_PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise SubmitError(f"package {package} not found: is chatpipe installed?")
        folder = Path(list(spec.submodule_search_locations)[0])
        for path in sorted(folder.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                files.append((f"{package}/{path.relative_to(folder).as_posix()}", path))
    return files


def project_zip(cache_dir: Path) -> Path:
    """A zip of ``PROJECT_PACKAGES`` (code and package data), named by its content's hash.

    The same code gives the same file (reused, and Spark sees one name per content); changed
    code gives a new name, so an executor never keeps a stale copy of an older zip.
    """
    files = _package_files()
    digest = hashlib.sha256()
    for name, path in files:
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    target = Path(cache_dir).expanduser() / "py" / f"chatpipe-{digest.hexdigest()[:16]}.zip"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, path in files:
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))  # fixed: same content, same bytes
            info.external_attr = 0o644 << 16
            zf.writestr(info, path.read_bytes(), compress_type=zipfile.ZIP_DEFLATED)
    tmp.replace(target)  # atomic: a concurrent job never reads half a zip
    return target


def executor_python(conf: dict[str, str]) -> str:
    return conf.get("spark.pyspark.python") or sys.executable


def ship_project(spark, conf: dict[str, str], cache_dir: Path, *, submitted: bool) -> None:
    """On a cluster, make the executors import the project from a shipped zip (not from whatever
    the worker machine has); unless spark-submit chose it (``submitted``), make them run this
    venv's Python (or ``spark.pyspark.python``)."""
    sc = spark.sparkContext
    if not submitted:
        sc.pythonExec = executor_python(conf)  # read by pyspark whenever it builds a Python function
    if not is_local(sc.master):
        shipped = project_zip(cache_dir)
        sc.addPyFile(str(shipped))
        # addPyFile reaches the Python workers' sys.path, not the processes they start: TorchDistributor's
        # training processes are torchrun children of a worker, and would import the training code from
        # whatever the worker machine has installed, or fail. The environment reaches them: the workers' (and
        # so their children's) PYTHONPATH gets the zip, by the name it has in the executors' working folder,
        # where Spark puts added files and where the children start.
        sc.environment["PYTHONPATH"] = os.pathsep.join(filter(None, [shipped.name, sc.environment.get("PYTHONPATH")]))
        # addPyFile also puts the zip first on this driver's sys.path; the driver keeps importing the
        # installed packages (their data files, e.g. schemas/avro, are not readable inside a zip).
        from pyspark import SparkFiles

        local_copy = os.path.join(SparkFiles.getRootDirectory(), shipped.name)
        while local_copy in sys.path:
            sys.path.remove(local_copy)


def under_spark_submit() -> bool:
    """True when spark-submit started this Python process (pyspark's own signal: the JVM is
    already running and left its gateway port in the environment)."""
    # pyspark's own variable (set by spark-submit for this process, read by pyspark's launch_gateway), not a
    # setting: asking the environment the same question pyspark asks is the only true answer.
    return "PYSPARK_GATEWAY_PORT" in os.environ


def missing_connectors() -> list[str]:
    """Connector classes the running driver JVM cannot load (connects to spark-submit's JVM; starts nothing)."""
    from py4j.java_gateway import JavaClass
    from pyspark import SparkContext

    SparkContext._ensure_initialized()
    # py4j resolves jvm.a.b.C to a JavaClass only when the class loads (a JavaPackage otherwise)
    return [name for name in CONNECTOR_CLASSES
            if not isinstance(functools.reduce(getattr, name.split("."), SparkContext._jvm), JavaClass)]


def check_submitted(jars: list[Path], script: str | None = None) -> None:
    """Under spark-submit: stop with one line naming the ``--jars`` to add if the connectors are missing.

    Exits (``SystemExit`` with the message: spark-submit prints it without a traceback) rather
    than raising, since this runs only as the main program of a spark-submit run.
    """
    missing = missing_connectors()
    if not missing:
        return
    job = next((name for name, mod in JOB_MODULES.items() if script and script.endswith(mod.split(".")[-1] + ".py")),
               "<job>")
    raise SystemExit(
        f"error: spark-submit started this job without Spark's Kafka/Avro connector jars ({', '.join(missing)} not "
        f"loadable); add to spark-submit: --jars {','.join(str(j) for j in jars)}  "
        f"(or run: chatpipe spark submit {job} -- <job flags>, which adds them and the project code)")


def job_script(job: str) -> Path:
    """The file spark-submit runs for ``job`` (``finetune-dataset`` | ``usage-report``)."""
    if job not in JOB_MODULES:
        raise SubmitError(f"unknown job {job!r}: one of {', '.join(JOB_MODULES)}")
    spec = importlib.util.find_spec(JOB_MODULES[job])
    assert spec is not None and spec.origin is not None
    return Path(spec.origin)


def submit_command(job: str, master: str, job_args: list[str], conf: dict[str, str], spark_home: Path) -> list[str]:
    """The spark-submit command line that runs ``job`` on ``master`` with everything it needs.

    No ``--py-files``: spark-submit would put the zip first on the *driver's* path too, where the
    installed packages must win (package data is not readable from a zip); the job's session
    ships the zip to the executors itself (:func:`ship_project`). ``conf``: the session conf (``session.session_conf``): its jars become ``--jars``, its driver
    memory ``--driver-memory`` (both must be known when the driver's JVM starts).
    """
    python = executor_python(conf)
    cmd = [str(spark_home / "bin" / "spark-submit"), "--master", master, "--jars", conf["spark.jars"],
           "--conf", f"spark.pyspark.python={python}", "--conf", f"spark.pyspark.driver.python={python}",
           "--conf", "spark.log.level=WARN"]  # as the session sets it: no screen of INFO lines
    if "spark.driver.memory" in conf:
        cmd += ["--driver-memory", conf["spark.driver.memory"]]
    return cmd + [str(job_script(job)), *job_args]


def shell_line(cmd: list[str], env: dict[str, str]) -> str:
    return " ".join([f"{k}={shlex.quote(v)}" for k, v in env.items()] + [shlex.quote(c) for c in cmd])
