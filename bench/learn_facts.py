"""Does fine-tuning on the pipeline's own logs teach the model? Planted facts, end to end.

Conversations in which the assistant states facts no model can know (an invented country's invented
capital, ``chatpipe.testing.planted_facts``), each answer liked by its user, are written as the streams
tier's archive; ``chatpipe job finetune-dataset`` (Spark) turns them into a dataset; ``chatpipe train lora
--processes 2`` (TorchDistributor, DDP over gloo) trains an adapter on it. Then the base model and the
adapter answer held-out questions about the facts, worded unlike any training line (greedy decoding); a
question counts as answered when the answer holds the planted capital.

Every fact is in the training split (``--validation-fraction 0``): the held-out questions are the eval.
Each fact is asked 6 ways, each question the first turn of a conversation of its own (a later turn has the
fact in its history, and an answer copied from the context teaches no recall). Full: 12 facts (72 liked
turns), 10 epochs at lr 1e-3, global batch 8; ``--quick``: 4 facts (about 3 minutes, most of it the
dataset job's and the processes' starts). The last line is the adapter's share of held-out questions
answered against the base model's (the issue's goal: >= 80% against <= 5%).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chatpipe.testing.planted_facts import facts, held_out, planted_log, write_planted_archive
from inference.engine.settings import EngineSettings
from training.answers import answer_questions

START_MS = 1_767_225_600_000  # 2026-01-01
OWNERS = [("acme", "ada"), ("acme", "bob"), ("acme", "cyd")]


def cli(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "chatpipe.cli", *args], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"chatpipe {' '.join(args[:2])} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 facts (about 3 minutes)")
    parser.add_argument("--facts", type=int, default=None, help="planted facts (default 12, --quick 4)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--wordings", type=int, default=6, help="questions asked per fact in the log (at most 6)")
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    planted = facts(args.facts or (4 if args.quick else 12))
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; {len(planted)} facts, "
          f"{args.wordings} wordings each, {args.epochs} epochs, lr {args.lr}, 2 processes")
    with tempfile.TemporaryDirectory(prefix="chatpipe-bench-facts-") as tmp:
        root = Path(tmp)
        turns, feedback = planted_log(planted, OWNERS, START_MS, args.wordings)
        write_planted_archive(root / "archive", turns, feedback)
        started = time.perf_counter()
        cli("job", "finetune-dataset", "--source", "archive", "--archive-dir", str(root / "archive"),
            "--since", "2026-01-01T00:00:00", "--until", "2026-01-02T00:00:00", "--out", str(root / "ds"),
            "--validation-fraction", "0", "--quiet")
        lines = sum(1 for _ in open(root / "ds" / "sft" / "train.jsonl"))
        print(f"dataset job: {len(turns)} liked turns -> {lines} training examples in {time.perf_counter() - started:.0f} s")
        started = time.perf_counter()
        cli("train", "lora", "--dataset", str(root / "ds"), "--no-publish", "--processes", "2", "--epochs",
            str(args.epochs), "--lr", str(args.lr), "--batch-size", "4", "--runs-dir", str(root / "runs"),
            "--run-name", "facts", "--no-progress", "--seed", "7")
        print(f"train lora --processes 2: {time.perf_counter() - started:.0f} s")
        model = EngineSettings().default_model_dir()
        questions = held_out(planted)
        base = answer_questions(model, [q for q, _ in questions])
        tuned = answer_questions(model, [q for q, _ in questions], adapter=root / "runs" / "facts" / "adapter")
        knew = sum(f.capital in a for a, (_, f) in zip(base, questions))
        learned = sum(f.capital in a for a, (_, f) in zip(tuned, questions))
        for (q, f), a in list(zip(questions, tuned))[:4]:
            print(f"  {q!r} -> {a.strip()[:80]!r}")
    print(f"held-out questions answered: base {knew}/{len(questions)}, adapter {learned}/{len(questions)}")
    print(f"learn facts/adapter vs base, share of held-out questions answered = {learned / len(questions):.2f} "
          f"vs {knew / len(questions):.2f}")


if __name__ == "__main__":
    main()
