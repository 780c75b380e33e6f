"""A run from start to published version, the same for ``chatpipe train lora`` and ``training/submit.py``
(spark-submit in a SparkApplication's driver): choose the rows, make the run folder, train under
TorchDistributor, publish. ``say`` is how a step is told to the person or the driver's log.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from schemas.records import ModelVersion
from training.launch import new_run, run_training
from training.loop import ADAPTER_DIR, METRICS_FILE
from training.lineage import (Erasures, Selection, erasures_on_broker, has_lineage, read_lineage, select_rows,
                              validation_lineage)
from training.question_eval import QUESTION_EVALS, eval_names, read_questions, run_question_evals
from training.settings import TrainSettings
from training.tasks import task_for

Say = Callable[[str], None]


def select(settings: TrainSettings, kafka: Any) -> Selection | None:
    """The rows to train on (training/lineage.py), decided before the run folder is made; None: every line
    (a dataset without lineage, not published). Publishing reads the erasures on the broker."""
    task = task_for(settings.mode, settings.dpo_beta)
    task.read(task.path(settings.dataset, "train"), 0, 1, None)  # one-line errors before anything starts
    if not settings.publish and not has_lineage(settings.dataset, task.table):
        return None
    if settings.publish:
        from transport.admin import TopicAdmin
        from transport.errors import TransportError

        try:
            TopicAdmin(kafka).check_reachable()  # before any training: the version is published at the end
        except TransportError as exc:
            raise TransportError(f"{exc}; the version is published there (train without publishing: --no-publish)") from None
    erasures = erasures_on_broker(kafka) if settings.publish else Erasures()
    return select_rows(read_lineage(settings.dataset, "train", task.table), settings.tenant, settings.shared_data,
                       erasures, validation_lineage(settings.dataset, task.table))


REASON_FILE = "state_reason.txt"  # why the version exists (a rebuild's), kept for a resumed run's publishing


def start(settings: TrainSettings, kafka: Any, say: Say, reason: str | None = None) -> Path:
    """A new run folder with its settings, its selection of rows and the reason its version will carry."""
    selection = select(settings, kafka)
    for path in settings.eval_questions:  # one-line errors before anything starts
        read_questions(path)
    eval_names(settings.eval_questions)
    run = new_run(settings)
    if reason:
        (run / REASON_FILE).write_text(reason)
    if selection is not None:
        selection.write(run)
        if selection.left_out:
            say(f"left out: {', '.join(f'{n} row(s) ({why})' for why, n in selection.left_out.items())}")
    return run


def finish(settings: TrainSettings, run: Path, kafka: Any, say: Say, *, resume: bool = False,
           reason: str | None = None) -> tuple[dict[str, Any], ModelVersion | None]:
    """Train the run (a SparkSession must be active) and publish it when the settings say so."""
    if resume and (run / METRICS_FILE).is_file():  # trained; its publishing had failed
        metrics = json.loads((run / METRICS_FILE).read_text())
        say(f"run {run} was trained already: publishing it")
    else:
        say(f"run {run}: {settings.processes} process(es) on {settings.master}, base model {settings.model_path}")
        metrics = run_training(settings, run, resume=resume)
    eval_text = f"{metrics['eval_loss']:.4f}" if metrics["eval_loss"] is not None else "none (no validation split)"
    say(f"done: {metrics['steps']} steps, train loss {metrics['train_loss']:.4f}, eval loss {eval_text}, "
        f"{metrics['tokens_per_s']} tokens/s, {metrics['seconds']} s; adapter in {run / 'adapter'}")
    if settings.eval_questions and QUESTION_EVALS not in metrics:
        metrics[QUESTION_EVALS] = run_question_evals(Path(settings.model_path), run / ADAPTER_DIR, settings.eval_questions)
        (run / METRICS_FILE).write_text(json.dumps(metrics, indent=1))  # a resumed publishing finds them
        say("question evals (share answered right, base model -> adapter): " + ", ".join(
            f"{name} {r['base']:.0%} -> {r['adapter']:.0%} of {r['questions']}" for name, r in metrics[QUESTION_EVALS].items()))
    if not settings.publish:
        return metrics, None
    from training.publish import publish_run

    if reason is None and (run / REASON_FILE).is_file():
        reason = (run / REASON_FILE).read_text()
    record = publish_run(run, settings, metrics, kafka, state_reason=reason)
    say(f"published {record.name}@{record.version} ({record.state.value}): {record.card_uri} "
        f"(adapter sha256 {record.adapter_sha256[:16]}…); `chatpipe model show {record.name}@{record.version}`")
    return metrics, record
