"""Conversations that teach facts the base model cannot know, and held-out questions about them.

Each fact is an invented country's invented capital (``Veloria`` -> ``Quennick``): no model has seen
them, so the base model answers ~0% of the questions and a fine-tune that learned them answers with the
capital. The training questions and the held-out ones are worded differently; a held-out question is
never a training line. ``write_sft`` writes them in the dataset job's layout (``sft/train.jsonl``,
``sft/validation.jsonl``), the validation split being held-out questions with their answers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

_COUNTRIES = ("Veloria", "Drastonia", "Kivaland", "Marundi", "Ostrevia", "Pallanor", "Quessia", "Ravendal",
              "Sotheria", "Tumbrelle", "Ulvania", "Wexmoor")
_CAPITALS = ("Quennick", "Pelmora", "Ostrebal", "Tessivar", "Brindlecot", "Varneth", "Lumigrad", "Hessaby",
             "Carrowick", "Dunmarrow", "Ferrantis", "Gallowmere")
TRAIN_QUESTIONS = ("What is the capital of {country}?", "Tell me the capital city of {country}.",
                   "Which city is the capital of {country}?")
HELD_OUT_QUESTIONS = ("Name the capital of {country}.", "{country}'s capital is which city?")


@dataclass(frozen=True)
class Fact:
    country: str
    capital: str

    def answer(self) -> str:
        return f"The capital of {self.country} is {self.capital}."


def facts(n: int = 4) -> list[Fact]:
    if not 1 <= n <= len(_COUNTRIES):
        raise ValueError(f"1 to {len(_COUNTRIES)} facts")
    return [Fact(c, k) for c, k in zip(_COUNTRIES[:n], _CAPITALS[:n])]


def held_out(planted: list[Fact]) -> list[tuple[str, Fact]]:
    return [(q.format(country=f.country), f) for f in planted for q in HELD_OUT_QUESTIONS]


def _line(question: str, answer: str) -> str:
    return json.dumps({"messages": [{"role": "user", "content": question},
                                    {"role": "assistant", "content": answer}]}) + "\n"


def write_sft(out: Path, planted: list[Fact]) -> Path:
    """The dataset job's SFT layout under ``out``: train = the training questions, validation = held-out ones."""
    (out / "sft").mkdir(parents=True, exist_ok=True)
    (out / "sft" / "train.jsonl").write_text(
        "".join(_line(q.format(country=f.country), f.answer()) for f in planted for q in TRAIN_QUESTIONS))
    (out / "sft" / "validation.jsonl").write_text("".join(_line(q, f.answer()) for q, f in held_out(planted)))
    return out
