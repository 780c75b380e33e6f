"""The training loop of one process of a run: LoRA (peft) on the base model, DDP across processes.

``train_process`` is what TorchDistributor starts in every process (torchrun sets RANK, WORLD_SIZE,
MASTER_ADDR/PORT); with one process it also runs without any of that. Each process trains on its own
shard (``sft_data``); DDP all-reduces the adapter's gradients (a few MB at rank 16: LoRA's gradients are
small, so the all-reduce costs little beside the forward and backward passes). Process 0 writes the run's
progress (``progress.jsonl``, one line a step, which the launcher turns into a progress bar), the
checkpoints' shared state, the adapter and ``metrics.json``; every process writes its random state.

What a step optimises (SFT's answer-token loss, or DPO's on preference pairs) is the run's task
(``tasks.py``); the loop around it is the same.

A plain loop, not transformers' ``Trainer``: the run needs its own shard order, its checkpoint layout
(every process's state, renamed complete) and a step-exact resume, which are the larger part of what a
Trainer would be configured to do here.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch

from training import checkpoints
from training.lineage import Selection
from training.tasks import task_for
from training.settings import TrainSettings
from training.sft_data import (DatasetError, ShardedExamples, batches, count_examples, epoch_order,
                               shard_size)

PROGRESS_FILE = "progress.jsonl"
METRICS_FILE = "metrics.json"
ADAPTER_DIR = "adapter"
#: Drills (tests/training, tests/spark, bench/train.py), off unless set: the process of rank DIE_RANK exits at once
#: (os._exit, as a SIGKILL would) after step DIE_AFTER; the process of rank SLOW_RANK
#: sleeps SLOW_S seconds in every step (a straggler).
DRILL_DIE_RANK = "CHATPIPE_TRAIN_DRILL_DIE_RANK"
DRILL_DIE_AFTER = "CHATPIPE_TRAIN_DRILL_DIE_AFTER"
DRILL_SLOW_RANK = "CHATPIPE_TRAIN_DRILL_SLOW_RANK"
DRILL_SLOW_S = "CHATPIPE_TRAIN_DRILL_SLOW_S"


class _Group:
    """The process group, or its absence with one process (then every collective is the identity)."""

    def __init__(self) -> None:
        self.rank, self.size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        if self.size > 1:
            torch.distributed.init_process_group("gloo")

    def barrier(self) -> None:
        if self.size > 1:
            torch.distributed.barrier()

    def sum(self, *values: float) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64)
        if self.size > 1:
            torch.distributed.all_reduce(tensor)
        return tensor.tolist()

    def close(self) -> None:
        if self.size > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _lr_lambda(settings: TrainSettings, total_steps: int):
    warmup = settings.warmup_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))
    return factor


def _load(settings: TrainSettings):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if settings.model_path is None:
        raise ValueError("model_path is unset: the launcher resolves the default model before the processes start")
    tokenizer = AutoTokenizer.from_pretrained(settings.model_path, local_files_only=True)
    base = AutoModelForCausalLM.from_pretrained(settings.model_path, local_files_only=True, dtype=torch.float32)
    torch.manual_seed(settings.seed)  # the adapter's initialisation: the same in every process
    config = LoraConfig(r=settings.lora_r, lora_alpha=settings.lora_alpha, lora_dropout=settings.lora_dropout,
                        target_modules=list(settings.target_modules), task_type="CAUSAL_LM")
    return tokenizer, get_peft_model(base, config)


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def evaluate(task, model, examples: ShardedExamples, pad_id: int, batch_size: int, group: _Group) -> float | None:
    """The task's mean eval loss over every process's shard of a split (None if it has nothing to score)."""
    model.eval()
    loss_sum = count = 0.0
    with torch.no_grad():
        for ids in batches(range(len(examples)), batch_size):
            batch_sum, n = task.eval_sums(model, [examples[i] for i in ids], pad_id)
            loss_sum += batch_sum
            count += n
    model.train()
    loss_sum, count = group.sum(loss_sum, count)
    return loss_sum / count if count else None


def train_process(settings_dict: dict[str, Any], run_dir: str, resume: bool) -> dict[str, Any] | None:
    """Train one process's part of a run; process 0 returns the run's metrics."""
    settings = TrainSettings(**settings_dict)
    run = Path(run_dir)
    torch.set_num_threads(settings.threads_per_process)
    group = _Group()
    # Where each process runs and which code it runs: on a cluster, the working folder names the executor, and
    # the code should be the zip the driver shipped (spark_jobs/shipping.py), not what the machine has installed.
    print(f"process {group.rank} of {group.size} for {run}: pid {os.getpid()} on {socket.gethostname()}, working "
          f"folder {os.getcwd()}, training code from {Path(__file__).parent}", flush=True)
    try:
        return _train(settings, run, resume, group)
    finally:
        group.close()


def _train(settings: TrainSettings, run: Path, resume: bool, group: _Group) -> dict[str, Any] | None:
    started = time.monotonic()
    tokenizer, model = _load(settings)
    pad_id = _pad_id(tokenizer)
    task = task_for(settings.mode, settings.dpo_beta)
    train_path = task.path(settings.dataset, "train")
    selection = Selection.read(run)  # the lines chosen by the launcher (tenant scope, erasures); None: all
    selected = selection.lines if selection is not None else None
    total = len(selected) if selected is not None else count_examples(train_path)
    if total < group.size:
        raise DatasetError(f"{train_path} has {total} examples to train on, fewer than the {group.size} processes")
    shard = ShardedExamples(task.read(train_path, group.rank, group.size, selected), tokenizer, settings.max_seq_len,
                            task.item)
    padded = shard_size(total, group.size)
    per_epoch = math.ceil(padded / settings.batch_size)
    total_steps = settings.max_steps or per_epoch * settings.epochs

    trained = model
    if group.size > 1:
        trained = torch.nn.parallel.DistributedDataParallel(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.learning_rate, weight_decay=settings.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(settings, total_steps))
    step, history, tokens_seen = 0, [], 0
    resumed_from = eval_before = None
    validation = _validation(task, settings, tokenizer, group, selection.validation_lines if selection else None)
    if resume and (latest := checkpoints.latest(run)) is not None:
        state = checkpoints.read_state(latest)
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, state["adapter"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        step, history, tokens_seen = state["step"], state["history"], state["tokens"]
        eval_before = state.get("eval_before")
        checkpoints.read_rng(latest, group.rank)
        resumed_from = step
    elif validation is not None:  # the base model's loss: the adapter starts as the identity (LoRA's B is 0)
        eval_before = evaluate(task, model, validation, pad_id, settings.batch_size, group)
    progress = open(run / PROGRESS_FILE, "a", encoding="utf-8") if group.rank == 0 else None
    if progress:
        progress.write(json.dumps({"event": "start", "step": step, "total_steps": total_steps,
                                   "processes": group.size, "examples": total}) + "\n")
        progress.flush()
    die_after = int(os.environ.get(DRILL_DIE_AFTER, 0)) if os.environ.get(DRILL_DIE_RANK) == str(group.rank) else 0
    slow_s = float(os.environ.get(DRILL_SLOW_S, 0)) if os.environ.get(DRILL_SLOW_RANK) == str(group.rank) else 0.0
    model.train()
    window_started, window_tokens = time.monotonic(), 0
    while step < total_steps:
        epoch, in_epoch = divmod(step, per_epoch)
        order = epoch_order(len(shard), padded, settings.seed, epoch)
        ids = list(batches(order, settings.batch_size))[in_epoch]
        if slow_s:
            time.sleep(slow_s)
        loss, batch_tokens = task.step_loss(trained, model, [shard[i] for i in ids], pad_id)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        mean_loss, step_tokens = group.sum(loss.item() / group.size, float(batch_tokens))
        tokens_seen += int(step_tokens)
        window_tokens += int(step_tokens)
        history.append({"step": step, "loss": mean_loss, "lr": schedule.get_last_lr()[0]})
        if progress:
            elapsed = time.monotonic() - window_started
            progress.write(json.dumps({"event": "step", "step": step, "total_steps": total_steps, "loss": mean_loss,
                                       "tokens_per_s": window_tokens / elapsed if elapsed > 0 else 0.0,
                                       "seconds": round(elapsed, 3)}) + "\n")
            progress.flush()
        if step % settings.checkpoint_every == 0 or step == total_steps:
            _checkpoint(run, step, model, optimizer, schedule, {"history": list(history), "tokens": tokens_seen,
                                                                "eval_before": eval_before}, settings, group)
        if die_after and step >= die_after:
            os._exit(137)

    eval_loss = None
    if validation is not None:
        eval_loss = evaluate(task, model, validation, pad_id, settings.batch_size, group)
    if group.rank != 0:
        return None
    model.save_pretrained(run / ADAPTER_DIR)
    tokenizer.save_pretrained(run / ADAPTER_DIR)
    metrics = {
        "steps": step, "total_steps": total_steps, "processes": group.size, "examples": total,
        "train_loss": history[-1]["loss"] if history else None, "eval_loss": eval_loss, "eval_loss_before": eval_before,
        "tokens": tokens_seen, "seconds": round(time.monotonic() - started, 2),
        "tokens_per_s": round(window_tokens / max(time.monotonic() - window_started, 1e-9), 1),
        "loop_seconds": round(time.monotonic() - window_started, 2),  # the steps of this start (after a resume: since it)
        "resumed_from": resumed_from, "history": history,
    }
    (run / METRICS_FILE).write_text(json.dumps(metrics, indent=1))
    if progress:
        progress.write(json.dumps({"event": "done", "step": step, "eval_loss": eval_loss}) + "\n")
        progress.close()
    return metrics


def _validation(task, settings: TrainSettings, tokenizer, group: _Group,
                lines: list[int] | None) -> ShardedExamples | None:
    """This process's shard of the validation split (of ``lines`` of it: the run's selection); None when the
    dataset has none, or none in the run's scope (the card says so)."""
    if lines == []:
        return None
    try:
        return ShardedExamples(task.read(task.path(settings.dataset, "validation"), group.rank, group.size, lines),
                               tokenizer, settings.max_seq_len, task.item)
    except DatasetError:
        return None


def _checkpoint(run: Path, step: int, model, optimizer, schedule, progress: dict[str, Any], settings,
                group: _Group) -> None:
    """``progress``: the run's history, tokens seen and eval loss before training (restored on resume)."""
    from peft import get_peft_model_state_dict

    staged = checkpoints.staging(run, step)
    if group.rank == 0:
        staged.mkdir(parents=True, exist_ok=True)
    group.barrier()
    checkpoints.write_rng(staged, group.rank)
    group.barrier()
    if group.rank == 0:
        state = {"adapter": get_peft_model_state_dict(model), "optimizer": optimizer.state_dict(),
                 "schedule": schedule.state_dict(), "step": step, **progress}
        checkpoints.publish(run, step, state, settings.keep_checkpoints)
    group.barrier()
