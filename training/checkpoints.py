"""A run's checkpoints: ``checkpoint-<step>/`` folders in the run folder, each complete or absent.

A checkpoint holds what resuming needs to take the same path on: the adapter's weights, the optimizer's
and the schedule's state, the step, the loss history, and every process's random state (``rng-<rank>.pt``:
dropout draws differ per process). It is written under ``.tmp`` and renamed once every process has written
its part, so a process killed mid-write leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch

_NAME = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "state.pt"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / f"checkpoint-{step:06d}"


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    found = [(int(m.group(1)), p) for p in run_dir.glob("checkpoint-*") if (m := _NAME.match(p.name))
             and (p / STATE_FILE).is_file()]
    return max(found)[1] if found else None


def staging(run_dir: Path, step: int) -> Path:
    return checkpoint_dir(run_dir, step).with_name(checkpoint_dir(run_dir, step).name + ".tmp")


def write_rng(folder: Path, rank: int) -> None:
    torch.save({"torch": torch.get_rng_state()}, folder / f"rng-{rank}.pt")


def read_rng(folder: Path, rank: int) -> None:
    path = folder / f"rng-{rank}.pt"
    if path.is_file():  # a run resumed with other processes than it was saved with has none for a new rank
        torch.set_rng_state(torch.load(path, weights_only=False)["torch"])


def publish(run_dir: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write the shared state into the staged folder, rename it complete, drop all but ``keep`` newest."""
    folder = staging(run_dir, step)
    torch.save(state, folder / STATE_FILE)
    final = checkpoint_dir(run_dir, step)
    if final.exists():
        shutil.rmtree(final)
    folder.rename(final)
    done = sorted(p for p in run_dir.glob("checkpoint-*") if _NAME.match(p.name))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def read_state(folder: Path) -> dict[str, Any]:
    return torch.load(folder / STATE_FILE, weights_only=False)
