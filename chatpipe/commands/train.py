"""``chatpipe train lora``: LoRA fine-tuning on the dataset job's output, DDP under TorchDistributor
(training/). torch, peft and pyspark are imported inside the command, so ``chatpipe --help`` stays instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from chatpipe.commands.common import build_settings, console
from chatpipe.options import option
from training.settings import TrainSettings  # pydantic only: the flags are made from its fields

train_app = typer.Typer(help="Fine-tune the served model on the pipeline's own datasets.", no_args_is_help=True)


def _opt(field: str, *flags: str):
    return option(TrainSettings, field, *flags)


@train_app.command("lora")
def lora(
    dataset: Annotated[Optional[Path], _opt("dataset")] = None,
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
) -> None:
    """Train a LoRA adapter on sft/*.jsonl (loss on the answers only); N processes with --processes N."""
    from training.launch import local_session, new_run, resumed_settings, run_training

    if resume is not None:
        run = resume.expanduser().resolve()
        settings = resumed_settings(run, **({"progress": progress} if progress is not None else {}))
    else:
        settings = build_settings(TrainSettings, dataset=dataset, model_path=_base_model(model_path), runs_dir=runs_dir,
                                  run_name=run_name, processes=processes, master=master,
                                  threads_per_process=threads_per_process, lora_r=lora_r, lora_alpha=lora_alpha,
                                  learning_rate=learning_rate, epochs=epochs, max_steps=max_steps,
                                  batch_size=batch_size, max_seq_len=max_seq_len, seed=seed,
                                  checkpoint_every=checkpoint_every, progress=progress)
        _check_dataset(settings)
        run = new_run(settings)
    console.print(f"run {run}: {settings.processes} process(es) on {settings.master}, base model {settings.model_path}")
    if settings.local:
        local_session(settings)
    else:
        _cluster_session(settings)
    metrics = run_training(settings, run, resume=resume is not None)
    eval_text = f"{metrics['eval_loss']:.4f}" if metrics["eval_loss"] is not None else "none (no validation split)"
    console.print(f"done: {metrics['steps']} steps, train loss {metrics['train_loss']:.4f}, eval loss {eval_text}, "
                  f"{metrics['tokens_per_s']} tokens/s, {metrics['seconds']} s; adapter in {run / 'adapter'}")


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


def _check_dataset(settings: TrainSettings) -> None:
    from training.sft_data import read_shard, split_path

    read_shard(split_path(settings.dataset, "train"), 0, 1)  # one-line errors before Spark starts


def _cluster_session(settings: TrainSettings):
    from spark_jobs.session import build_session
    from spark_jobs.settings import SparkSettings

    return build_session(SparkSettings(master=settings.master, app_name="chatpipe-train", jvm_functions=False))


def register(app: typer.Typer) -> None:
    app.add_typer(train_app, name="train")
