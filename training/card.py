"""The training card beside each adapter: what it was trained on, how, and what came of it.

``card.json`` (for programs), ``card.md`` (for people) and ``loss.png`` (the loss curve: people read a
curve faster than a table) in the version's artifact folder. The dataset part is its manifest: the
dataset job's own card (rows per output, drops by step and reason, erasures it applied) and its input's
date range, plus what this run left out (other tenants' rows, rows of users erased since the build).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from schemas.models import CARD_JSON, CARD_MD, LOSS_PNG
from training.question_eval import QUESTION_EVALS

DATASET_CARD = "dataset_card.json"  # the dataset job's (spark_jobs/card.py)


def _day(ms: int | None) -> str | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def dataset_summary(dataset: Path, manifest_id: str, selection: Any, lineage: Any) -> dict[str, Any]:
    """The dataset's manifest as the card shows it."""
    path = Path(dataset) / DATASET_CARD
    job_card = json.loads(path.read_text()) if path.is_file() else {}
    oldest = lineage.column("oldest_at").to_pylist() if lineage is not None else []
    return {
        "uri": str(dataset), "manifest_id": manifest_id,
        "rows": job_card.get("outputs", {}), "drops": job_card.get("drops", {}),
        "erasures_applied_by_build": job_card.get("erasure", {}),
        "input_range": [_day(job_card.get("input", {}).get("since_ms")), _day(job_card.get("input", {}).get("until_ms"))],
        "examples_range": [_day(min(oldest, default=None)), _day(max(oldest, default=None))],
        "trained_rows": len(selection.lines), "tenants": selection.tenants, "tenant_scope": selection.tenant,
        "left_out_by_this_run": selection.left_out,
    }


def write_card(folder: Path, *, name: str, version: int, base_model: str, base_model_sha256: str,
               settings: dict[str, Any], metrics: dict[str, Any], dataset: dict[str, Any]) -> dict[str, Any]:
    """Write card.json, card.md and loss.png into ``folder``; returns the card."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    card = {
        "model": f"{name}@{version}", "base_model": base_model, "base_model_sha256": base_model_sha256,
        "dataset": dataset,
        "hyperparameters": {k: settings[k] for k in ("mode", "dpo_beta", "lora_r", "lora_alpha", "lora_dropout", "target_modules",
                                                     "learning_rate", "warmup_steps", "weight_decay", "epochs",
                                                     "max_steps", "batch_size", "max_seq_len", "seed")},
        "eval": {"loss_before": metrics.get("eval_loss_before"), "loss_after": metrics.get("eval_loss"),
                 "split": ("preference" if settings["mode"] == "dpo" else "sft") + "/validation.jsonl",
                 "unit": "pair (DPO loss)" if settings["mode"] == "dpo" else "answer token",
                 "questions": metrics.get(QUESTION_EVALS, {})},
        "train_loss": metrics.get("train_loss"), "steps": metrics["steps"], "processes": metrics["processes"],
        "master": settings["master"], "wall_seconds": metrics["seconds"], "tokens": metrics["tokens"],
        "tokens_per_s": metrics["tokens_per_s"], "resumed_from": metrics.get("resumed_from"),
        "loss_curve": LOSS_PNG,
    }
    (folder / CARD_JSON).write_text(json.dumps(card, indent=1, sort_keys=True) + "\n")
    (folder / CARD_MD).write_text(_markdown(card))
    plot_loss(metrics.get("history", []), folder / LOSS_PNG, f"{name}@{version}")
    return card


def plot_loss(history: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], marker=".", label="train loss (per step)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{title}: training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else ("-" if value is None else str(value))


def _markdown(card: dict[str, Any]) -> str:
    d = card["dataset"]
    lines = [
        f"# Training card: {card['model']}", "",
        f"Base model: `{card['base_model']}` (sha256 `{card['base_model_sha256'][:16]}…`)", "",
        "## Dataset", "",
        f"- `{d['uri']}` (manifest `{d['manifest_id'][:16]}…`)",
        f"- input range: {d['input_range'][0]} to {d['input_range'][1]}; examples' oldest records: "
        f"{d['examples_range'][0]} to {d['examples_range'][1]}",
        f"- rows: {', '.join(f'{k} {v}' for k, v in d['rows'].items()) or '-'}",
        f"- trained on {d['trained_rows']} rows of tenants {', '.join(d['tenants'])} "
        f"(scope: {d['tenant_scope'] or 'shared data'}); left out by this run: "
        f"{', '.join(f'{k} {v}' for k, v in d['left_out_by_this_run'].items()) or 'none'}",
        f"- dropped by the dataset job: "
        f"{'; '.join(f'{step}: ' + ', '.join(f'{r} {n}' for r, n in reasons.items()) for step, reasons in d['drops'].items()) or 'none'}",
        "", "## Hyperparameters", "", "| name | value |", "|---|---|",
        *(f"| {k} | {v} |" for k, v in card["hyperparameters"].items()),
        "", "## Results", "",
        f"- eval loss (`{card['eval']['split']}`, per {card['eval']['unit']}): before {_fmt(card['eval']['loss_before'])}, "
        f"after {_fmt(card['eval']['loss_after'])}",
        *(f"- questions `{name}` ({r['questions']}): {r['base']:.0%} answered right by the base model, "
          f"{r['adapter']:.0%} with the adapter" for name, r in card["eval"]["questions"].items()),
        f"- final train loss {_fmt(card['train_loss'])} after {card['steps']} steps",
        f"- {card['processes']} process(es) on {card['master']}, {card['wall_seconds']} s, "
        f"{card['tokens_per_s']} tokens/s" + (f"; resumed from step {card['resumed_from']}" if card["resumed_from"] else ""),
        "", f"![loss curve]({card['loss_curve']})", "",
    ]
    return "\n".join(lines)
