"""``chatpipe train lora``: LoRA fine-tuning on the dataset job's output, DDP under TorchDistributor
(training/). torch, peft and pyspark are imported inside the command, so ``chatpipe --help`` stays instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from chatpipe.commands.common import build_settings, console, with_kafka_flags
from chatpipe.options import option
from training.settings import TrainSettings  # pydantic only: the flags are made from its fields

train_app = typer.Typer(help="Fine-tune the served model on the pipeline's own datasets.", no_args_is_help=True)


def _opt(field: str, *flags: str):
    return option(TrainSettings, field, *flags)


@train_app.command("lora")
@with_kafka_flags
def lora(
    dataset: Annotated[Optional[Path], _opt("dataset")] = None,
    mode: Annotated[Optional[str], _opt("mode")] = None,
    dpo_beta: Annotated[Optional[float], _opt("dpo_beta")] = None,
    tenant: Annotated[Optional[str], _opt("tenant")] = None,
    shared_data: Annotated[Optional[bool], _opt("shared_data", "--shared-data")] = None,
    publish: Annotated[Optional[bool], _opt("publish", "--publish/--no-publish")] = None,
    eval_questions: Annotated[Optional[list[Path]], option(TrainSettings, "eval_questions", "--eval-questions", metavar="FILE")] = None,
    model_name: Annotated[Optional[str], _opt("model_name")] = None,
    artifact_store: Annotated[Optional[str], _opt("artifact_store")] = None,
    model_path: Annotated[Optional[Path], _opt("model_path", "--model")] = None,
    runs_dir: Annotated[Optional[Path], _opt("runs_dir")] = None,
    run_name: Annotated[Optional[str], _opt("run_name")] = None,
    processes: Annotated[Optional[int], _opt("processes")] = None,
    master: Annotated[Optional[str], _opt("master")] = None,
    threads_per_process: Annotated[Optional[int], _opt("threads_per_process")] = None,
    lora_r: Annotated[Optional[int], _opt("lora_r")] = None,
    lora_alpha: Annotated[Optional[int], _opt("lora_alpha")] = None,
    learning_rate: Annotated[Optional[float], _opt("learning_rate", "--lr")] = None,
    epochs: Annotated[Optional[int], _opt("epochs")] = None,
    max_steps: Annotated[Optional[int], _opt("max_steps")] = None,
    batch_size: Annotated[Optional[int], _opt("batch_size")] = None,
    max_seq_len: Annotated[Optional[int], _opt("max_seq_len")] = None,
    seed: Annotated[Optional[int], _opt("seed")] = None,
    checkpoint_every: Annotated[Optional[int], _opt("checkpoint_every")] = None,
    progress: Annotated[Optional[bool], _opt("progress", "--progress/--no-progress")] = None,
    resume: Annotated[Optional[Path], typer.Option("--resume", metavar="RUN",
                                                   help="Go on with a run folder from its last checkpoint, "
                                                        "with the settings it was started with")] = None,
    rebuild: Annotated[Optional[str], typer.Option("--rebuild", metavar="NAME@VERSION",
                                                   help="Train a version again with its recorded settings (and "
                                                        "--dataset and --eval-questions if given), leaving out rows of users erased since: "
                                                        "the next version of its name")] = None,
    kafka=None,
) -> None:
    """Train a LoRA adapter on sft/*.jsonl (loss on the answers only) or, --mode dpo, on preference/*.jsonl;
    N processes with --processes N; publish it as a model version (artifact store + chat.models)."""
    from training.flow import finish, start
    from training.launch import local_session, resumed_settings

    reason = None
    say = lambda line: console.print(line, markup=False, highlight=False)
    if resume is not None:
        run = resume.expanduser().resolve()
        settings = resumed_settings(run, **({"progress": progress} if progress is not None else {}))
        _check_master(settings)
    else:
        if rebuild is not None:
            settings, reason = _rebuilt_settings(
                rebuild, kafka, dataset=dataset, run_name=run_name, progress=progress, runs_dir=runs_dir,
                eval_questions=tuple(eval_questions) if eval_questions else None,
                artifact_store=artifact_store, processes=processes, master=master,
                threads_per_process=threads_per_process, checkpoint_every=checkpoint_every)
        else:
            settings = build_settings(
                TrainSettings, dataset=dataset, mode=mode, dpo_beta=dpo_beta, tenant=tenant, shared_data=shared_data,
                publish=publish, eval_questions=tuple(eval_questions) if eval_questions else None,
                model_name=model_name, artifact_store=artifact_store, model_path=_base_model(model_path),
                runs_dir=runs_dir, run_name=run_name, processes=processes, master=master,
                threads_per_process=threads_per_process, lora_r=lora_r, lora_alpha=lora_alpha,
                learning_rate=learning_rate, epochs=epochs, max_steps=max_steps, batch_size=batch_size,
                max_seq_len=max_seq_len, seed=seed, checkpoint_every=checkpoint_every, progress=progress)
        _check_master(settings)  # before the run folder is made
        run = start(settings, kafka, say, reason)
    if settings.local:
        local_session(settings)
    else:
        _cluster_session(settings)
    finish(settings, run, kafka, say, resume=resume is not None, reason=reason)


def _check_master(settings: TrainSettings) -> None:
    if settings.master == "session":
        raise typer.BadParameter("session is the master of training/submit.py under spark-submit (a SparkApplication); "
                                 "here: local or spark://host:port", param_hint="--master")


def _rebuilt_settings(ref: str, kafka, **changes):
    from training.publish import base_model_sha256, recorded_settings
    from transport.model_registry import find_version, read_model_versions

    try:
        old = find_version(read_model_versions(kafka), ref)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--rebuild") from None
    if old is None:
        raise typer.BadParameter(f"no version {ref} on the registry (`chatpipe model list`)", param_hint="--rebuild")

    base = _base_model(None)
    if base_model_sha256(base) != old.base_model_sha256:
        raise typer.BadParameter(f"{old.name}@{old.version} was trained on another base model than {base} (sha256 "
                                 f"{old.base_model_sha256[:16]}…): set CHATPIPE_TRAIN_MODEL_PATH to it", param_hint="--rebuild")
    # What it learned from and how (recorded), with where and how fast this run goes (the flags given).
    given = {k: v for k, v in changes.items() if v is not None}
    settings = build_settings(TrainSettings, **{**recorded_settings(old), "model_name": old.name, "model_path": base,
                                                "publish": True, **given})
    return settings, f"rebuilt from {old.name}@{old.version} ({old.state.value}) without rows of users erased since"


def _base_model(model_path: Path | None) -> Path:
    """The base model's folder: --model, CHATPIPE_TRAIN_MODEL_PATH, else the default model (pulled)."""
    from inference.engine.model_store import locate_model
    from inference.engine.settings import EngineSettings

    given = model_path or build_settings(TrainSettings).model_path
    location = locate_model(build_settings(EngineSettings, model_path=given))
    if location.gguf_file:
        raise typer.BadParameter("train from a Hugging Face model folder, not a .gguf file "
                                 "(`chatpipe model pull` converts the default model to one)", param_hint="--model")
    return location.folder


def _cluster_session(settings: TrainSettings):
    from spark_jobs.session import build_session
    from spark_jobs.settings import SparkSettings

    return build_session(SparkSettings(master=settings.master, app_name="chatpipe-train", jvm_functions=False))


def register(app: typer.Typer) -> None:
    app.add_typer(train_app, name="train")
