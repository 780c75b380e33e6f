"""Start a run: its folder, its processes under pyspark's TorchDistributor, its progress bar.

TorchDistributor (``pyspark.ml.torch.distributor``) is Spark's launcher for PyTorch DDP: in local mode
it runs ``torchrun`` with N processes on the driver's machine; on a cluster (``local_mode=False``) it
starts one barrier task per process on the executors, which rendezvous with each other. Either way it
pickles ``loop.train_process`` and its arguments, and returns what process 0 returns.

A run folder holds ``settings.json`` (what ``--resume`` trains with again), ``progress.jsonl``,
``checkpoint-<step>/``, and at the end ``adapter/`` and ``metrics.json``. On a cluster it must be on a
filesystem every executor writes to (a shared volume; the run's processes write their checkpoint parts there).
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from schemas.errors import ChatpipeError
from training.loop import METRICS_FILE, PROGRESS_FILE, train_process
from training.settings import TrainSettings

SETTINGS_FILE = "settings.json"
VERSION_FILE = "version.json"  # written when the run is published (training/publish.py)


class RunError(ChatpipeError):
    """A run folder that cannot be started or resumed, or a run whose processes failed."""


def new_run(settings: TrainSettings) -> Path:
    """Make the run's folder and write its settings; refuse a name already taken."""
    name = settings.run_name or "lora-" + datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    run = settings.runs_dir.expanduser().resolve() / name
    if run.exists():
        raise RunError(f"{run} exists: resume it with --resume {run}, or pick another --run-name")
    run.mkdir(parents=True)
    (run / SETTINGS_FILE).write_text(settings.model_dump_json(indent=1))
    return run


def resumed_settings(run: Path, **changes: Any) -> TrainSettings:
    """The settings a run was started with (``changes``: what may differ on resume, e.g. progress)."""
    path = Path(run) / SETTINGS_FILE
    if not path.is_file():
        raise RunError(f"{run} is not a run folder (no {SETTINGS_FILE})")
    settings = TrainSettings(**{**json.loads(path.read_text()), **changes})
    if (Path(run) / METRICS_FILE).is_file() and (not settings.publish or (Path(run) / VERSION_FILE).is_file()):
        raise RunError(f"{run} finished already ({METRICS_FILE} is there)")
    return settings  # trained and not published yet (the broker was away): a resume publishes it


def local_session(settings: TrainSettings):
    """The SparkSession TorchDistributor's local mode asks for (it runs nothing on it)."""
    from pyspark.sql import SparkSession

    return (SparkSession.builder.master("local[1]").appName("chatpipe-train")
            .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false").getOrCreate())


def run_training(settings: TrainSettings, run: Path, resume: bool = False) -> dict[str, Any]:
    """Train ``settings.processes`` processes under TorchDistributor; return process 0's metrics.
    An active SparkSession must exist (``local_session`` in local mode, the cluster's otherwise)."""
    from py4j.protocol import Py4JJavaError
    from pyspark.ml.torch.distributor import TorchDistributor

    distributor = TorchDistributor(num_processes=settings.processes, local_mode=settings.local, use_gpu=False)
    with _progress_bar(run / PROGRESS_FILE, enabled=settings.progress):
        try:
            metrics = distributor.run(train_process, settings.model_dump(mode="json"), str(run), resume)
        except (RuntimeError, Py4JJavaError) as exc:
            raise RunError(f"the training processes failed ({_first_line(exc)}); the last checkpoint stays in {run}: "
                           f"`chatpipe train lora --resume {run}` goes on from it") from exc
    if not metrics:
        raise RunError(f"the run in {run} returned no metrics")
    return metrics


def _first_line(exc: Exception) -> str:
    """What failed, in a line: local mode raises torchrun's RuntimeError; on a cluster the barrier job fails in the
    JVM (Spark does not retry a failed barrier result stage), and its Java stack trace follows the first line.
    The processes' own output went to this process's output as they ran."""
    from py4j.protocol import Py4JJavaError

    if isinstance(exc, Py4JJavaError):
        return str(exc.java_exception.getMessage()).splitlines()[0]
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


@contextmanager
def _progress_bar(progress_file: Path, enabled: bool) -> Iterator[None]:
    """A rich bar fed by process 0's ``progress.jsonl`` (the processes' own output is plain log lines)."""
    if not enabled:
        yield
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    stop = threading.Event()
    bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
                   TextColumn("{task.fields[rate]} tok/s"), TimeElapsedColumn(), TimeRemainingColumn())
    task = bar.add_task("train", total=None, loss="-", rate="-")

    def follow() -> None:
        offset = 0
        while not stop.is_set():
            if progress_file.is_file():
                with open(progress_file, encoding="utf-8") as lines:
                    lines.seek(offset)
                    for line in lines:
                        if not line.endswith("\n"):
                            break
                        offset += len(line.encode())
                        event = json.loads(line)
                        if event["event"] == "start":
                            bar.update(task, total=event["total_steps"], completed=event["step"])
                        elif event["event"] == "step":
                            bar.update(task, completed=event["step"], loss=f"{event['loss']:.3f}",
                                       rate=f"{event['tokens_per_s']:.0f}")
            time.sleep(0.5)

    follower = threading.Thread(target=follow, name="train-progress", daemon=True)
    with bar:
        follower.start()
        try:
            yield
        finally:
            stop.set()
            follower.join(timeout=2)
