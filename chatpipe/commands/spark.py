"""``chatpipe spark up | down | status | url | submit``: a Spark standalone cluster on this machine.

``up`` starts a master and two workers from the installed pyspark (``infra.spark_cluster``) and
waits until both are registered; ``url`` prints the master URL for ``--master``; ``submit`` runs
a job with the venv's spark-submit and everything a cluster needs on its command line
(connector jars, the project's code as a zip, the executors' Python). ``--print`` shows that
command instead, for a Spark installation elsewhere. Not here: the jobs' own options
(``chatpipe job ...``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from chatpipe.commands.common import build_settings, console, err_console, table
from chatpipe.options import option
from infra.spark_cluster_settings import SparkClusterSettings  # pydantic only: the flags are made from its fields
from spark_jobs.settings import SparkSettings

spark_app = typer.Typer(help="A Spark standalone cluster (master + workers) on this machine, and spark-submit.",
                        no_args_is_help=True)

StateDir = Annotated[Optional[Path], option(SparkClusterSettings, "state_dir", help="State folder")]
Workers = Annotated[Optional[int], option(SparkClusterSettings, "spark_workers", "--workers", "-n")]
Cores = Annotated[Optional[int], option(SparkClusterSettings, "spark_worker_cores", "--worker-cores")]
Memory = Annotated[Optional[str], option(SparkClusterSettings, "spark_worker_memory", "--worker-memory")]
Port = Annotated[Optional[int], option(SparkClusterSettings, "spark_master_port", "--port")]
WebPort = Annotated[Optional[int], option(SparkClusterSettings, "spark_webui_port", "--webui-port")]


def _settings(state_dir=None, workers=None, cores=None, memory=None, port=None, webui_port=None) -> "SparkClusterSettings":
    return build_settings(SparkClusterSettings, state_dir=state_dir, spark_workers=workers, spark_worker_cores=cores,
                          spark_worker_memory=memory, spark_master_port=port, spark_webui_port=webui_port)


def print_status(settings: "SparkClusterSettings") -> bool:
    """Print master, workers and running applications; True when the master and every worker are up."""
    from infra.spark_cluster import SparkCluster

    st = SparkCluster(settings).status()
    if st.master_url is None:
        console.print(f"no Spark cluster in {settings.spark_dir} (start one: chatpipe spark up)")
        return False
    state = "alive" if st.master_alive else ("starting" if st.master_pid else "stopped")
    console.print(f"Spark {st.version} master {st.master_url} ({state}, pid {st.master_pid or '-'}), "
                  f"web UI {st.webui_url}, state {settings.spark_dir}")
    workers = table("worker", "state", "pid", "port", "cores (used)", "memory MiB (used)", "folder", title="workers")
    for w in st.workers:
        wstate = "registered" if w.registered else ("starting" if w.pid else "stopped")
        workers.add_row(str(w.worker), wstate, str(w.pid or "-"), str(w.port), f"{w.cores} ({w.cores_used})",
                      f"{w.memory_mb} ({w.memory_used_mb})", str(w.dir))
    console.print(workers)
    if st.apps:
        apps = table("id", "name", "cores", "memory per executor MiB", "state", title="running applications")
        for a in st.apps:
            apps.add_row(str(a["id"]), str(a["name"]), str(a["cores"]), str(a["memory_per_executor_mb"]), str(a["state"]))
        console.print(apps)
    else:
        console.print("running applications: none")
    return st.master_alive and all(w.registered for w in st.workers)


@spark_app.command("up")
def up(state_dir: StateDir = None, workers: Workers = None, worker_cores: Cores = None, worker_memory: Memory = None,
       port: Port = None, webui_port: WebPort = None) -> None:
    """Start the master and the workers in the background; wait until every worker is registered."""
    from infra.spark_cluster import SparkCluster

    settings = _settings(state_dir, workers, worker_cores, worker_memory, port, webui_port)
    cluster = SparkCluster(settings)
    with console.status(f"starting the Spark master and {settings.spark_workers} worker(s)..."):
        started = cluster.up()
    console.print(f"Spark cluster {'started: ' + ', '.join(started) if started else 'already running'}")
    print_status(settings)
    console.print(f"run a job on it: chatpipe job finetune-dataset --master {cluster.master_url()} ...")


@spark_app.command("down")
def down(state_dir: StateDir = None) -> None:
    """Stop the master and workers (SIGTERM; SIGKILL after the timeout). Logs stay under <state>/spark."""
    from infra.spark_cluster import SparkCluster

    settings = _settings(state_dir)
    stopped = SparkCluster(settings).down()
    console.print(f"Spark cluster stopped: {', '.join(stopped)}" if stopped else "Spark cluster was not running")
    console.print(f"logs: {settings.spark_dir}")


@spark_app.command("status")
def status(state_dir: StateDir = None) -> None:
    """Master URL, workers with their cores and memory, running applications (exit 1 if not all up)."""
    if not print_status(_settings(state_dir)):
        raise typer.Exit(code=1)


@spark_app.command("url")
def url(state_dir: StateDir = None) -> None:
    """Print the running master's URL (spark://host:port), for --master; exit 1 if none runs."""
    from infra.spark_cluster import SparkCluster

    master = SparkCluster(_settings(state_dir)).master_url()
    if master is None:
        err_console.print("no Spark cluster is running (chatpipe spark up)")
        raise typer.Exit(code=1)
    print(master)


@spark_app.command("submit", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def submit(
    ctx: typer.Context,
    job: Annotated[str, typer.Argument(help="finetune-dataset | usage-report")],
    master: Annotated[Optional[str], option(
        SparkSettings, "master", help="Spark master URL: local[*], spark://..., yarn, k8s://...; neither flag nor "
        "variable given: the cluster of chatpipe spark up in the state folder if it runs, else the default")] = None,
    print_only: Annotated[bool, typer.Option("--print", help="Print the spark-submit command instead of running it")] = False,
    state_dir: StateDir = None,
) -> None:
    """Run a job with spark-submit: the job's flags follow (after --), e.g.
    chatpipe spark submit finetune-dataset -- --out data/ft --source archive --archive-dir /data/archive"""
    import subprocess

    from infra.spark_cluster import SparkCluster, spark_home
    from spark_jobs.session import session_conf
    from spark_jobs.shipping import job_script, shell_line, submit_command

    job_script(job)  # an unknown job fails here, before any jar is looked for
    spark_s = build_settings(SparkSettings, master=master)
    if "master" not in spark_s.model_fields_set:  # no --master, no CHATPIPE_SPARK_MASTER: a running cluster first
        running = SparkCluster(_settings(state_dir)).master_url()
        if running:
            spark_s = spark_s.model_copy(update={"master": running})
        err_console.print(f"master: {spark_s.master}")
    cmd = submit_command(job, spark_s.master, list(ctx.args), session_conf(spark_s), spark_home())
    env = {"SPARK_HOME": str(spark_home())}  # this pyspark's Spark, whatever SPARK_HOME the shell has
    if print_only:
        print(shell_line(cmd, env))
        return
    code = subprocess.run(cmd, env={**os.environ, **env}).returncode
    if code:
        raise typer.Exit(code=code)


def register(app: typer.Typer) -> None:
    app.add_typer(spark_app, name="spark")
