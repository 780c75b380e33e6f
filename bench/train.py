"""LoRA training: DDP scaling under TorchDistributor, and what Spark + torchrun cost over a plain loop.

Three runs of the same training (the default model, rank-16 adapters on every projection, planted-fact
conversations from ``chatpipe.testing.planted_facts``, the same steps and per-process batch):

1. a plain loop: ``training.loop.train_process`` called in this process (no Spark, no torchrun, no DDP);
2. ``chatpipe train lora``'s path with 1 process (TorchDistributor local mode, torchrun);
3. the same with 2 processes (DDP over gloo), one torch thread each.

Printed per run: the training tokens/s (the tokens of the batches, prompt and answer, over the loop's
time after the model is loaded), the wall time of the whole run (a Spark session, torchrun, model loads),
and the final loss. Then the scaling efficiency, 2 processes' tokens/s over 1 process's (goal >= 1.6 on
2 cores: each process does the same work per step and LoRA's all-reduce is a few MB), and the overhead,
the 1-process run's wall time over the plain loop's. The last line is the 2-vs-1 ratio.

Full mode adds a straggler: the 2-process run again with process 1 sleeping in every step as long as a
step took in the 2-process run (a process at half speed), and prints the seconds per step of both.

``--quick``: 4 steps each (about 2 minutes on 2 cores, most of it process starts); default 24 steps.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chatpipe.testing.planted_facts import facts, write_sft
from inference.engine.settings import EngineSettings
from training.launch import local_session, new_run, run_training
from training.loop import DRILL_SLOW_RANK, DRILL_SLOW_S, train_process
from training.settings import TrainSettings


def settings_for(root: Path, dataset: Path, name: str, steps: int, processes: int) -> TrainSettings:
    return TrainSettings(dataset=dataset, model_path=EngineSettings().default_model_dir(), runs_dir=root / "runs",
                         run_name=name, processes=processes, max_steps=steps, batch_size=4, learning_rate=1e-3,
                         checkpoint_every=10_000, progress=False)


def plain(root: Path, dataset: Path, steps: int) -> tuple[dict, float]:
    settings = settings_for(root, dataset, "plain", steps, 1)
    run = new_run(settings)
    started = time.perf_counter()
    metrics = train_process(settings.model_dump(mode="json"), str(run), False)
    return metrics, time.perf_counter() - started


def distributed(root: Path, dataset: Path, steps: int, processes: int, name: str = "") -> tuple[dict, float]:
    settings = settings_for(root, dataset, name or f"ddp{processes}", steps, processes)
    run = new_run(settings)
    started = time.perf_counter()
    local_session(settings)
    metrics = run_training(settings, run)
    return metrics, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 steps per run (about 2 minutes)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 24, --quick 4)")
    args = parser.parse_args()
    steps = args.steps or (4 if args.quick else 24)
    torch_threads = 1
    os.environ.setdefault("OMP_NUM_THREADS", str(torch_threads))
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; {steps} steps per run, "
          f"batch 4 per process, 1 torch thread per process")
    with tempfile.TemporaryDirectory(prefix="chatpipe-bench-train-") as tmp:
        root = Path(tmp)
        dataset = write_sft(root / "dataset", facts(12))
        rows = {}
        for name, run in (("plain loop, 1 process", lambda: plain(root, dataset, steps)),
                          ("TorchDistributor, 1 process", lambda: distributed(root, dataset, steps, 1)),
                          ("TorchDistributor, 2 processes", lambda: distributed(root, dataset, steps, 2))):
            metrics, wall = run()
            rows[name] = (metrics, wall)
            print(f"{name:30s} {metrics['tokens_per_s']:8.1f} tokens/s  whole run {wall:6.1f} s  "
                  f"(training {metrics['seconds']:.1f} s)  final loss {metrics['train_loss']:.3f}")
        one, two = rows["TorchDistributor, 1 process"], rows["TorchDistributor, 2 processes"]
        if not args.quick:
            step_s = two[0]["loop_seconds"] / two[0]["steps"]
            os.environ.update({DRILL_SLOW_RANK: "1", DRILL_SLOW_S: f"{step_s:.3f}"})
            slow, _ = distributed(root, dataset, steps, 2, name="straggler")
            for key in (DRILL_SLOW_RANK, DRILL_SLOW_S):
                del os.environ[key]
            print(f"straggler: process 1 sleeping {step_s:.2f} s a step: {slow['loop_seconds'] / slow['steps']:.2f} s "
                  f"a step against {step_s:.2f} s ({slow['tokens_per_s']:.1f} tokens/s)")
    overhead = one[1] / rows["plain loop, 1 process"][1]
    print(f"overhead of Spark + torchrun (1 process) over the plain loop, whole run: {overhead:.2f}x")
    print(f"train/2 processes vs 1, tokens/s = {two[0]['tokens_per_s'] / one[0]['tokens_per_s']:.2f}")


if __name__ == "__main__":
    main()
