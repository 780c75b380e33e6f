"""Question evals of a run (``--eval-questions FILE``): questions with the text a right answer contains, asked of
the base model and of the base model with the run's adapter (greedy, ``answers.py``); the share answered right
by each is in the version's ``eval_results`` (``<file stem>`` and ``<file stem>.base``) and a line of its card.

A file is JSON lines, one question each: ``{"question": "...", "expected": "..."}``; an answer is right when it
contains ``expected`` (case folded). The planted-knowledge check (``chatpipe.testing.planted_facts``) writes its
held-out paraphrases this way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from schemas.errors import ChatpipeError


#: Where a run's metrics.json keeps them (and the card reads them).
QUESTION_EVALS = "question_evals"


class QuestionFileError(ChatpipeError):
    """An eval file that cannot be read as questions (said before any training starts)."""


@dataclass(frozen=True)
class Question:
    question: str
    expected: str

    def answered_by(self, answer: str) -> bool:
        return self.expected.casefold() in answer.casefold()


def read_questions(path: Path) -> list[Question]:
    path = Path(path)
    if not path.is_file():
        raise QuestionFileError(f"{path}: no such eval file")
    questions = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise QuestionFileError(f"{path}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not all(isinstance(row.get(k), str) and row[k].strip()
                                                for k in ("question", "expected")):
            raise QuestionFileError(f"{path}:{number}: a line is {{\"question\": \"...\", \"expected\": \"...\"}}")
        questions.append(Question(row["question"], row["expected"]))
    if not questions:
        raise QuestionFileError(f"{path}: no questions")
    return questions


def eval_names(paths: tuple[Path, ...]) -> list[str]:
    """The result names of the files (their stems), refused when two files would share one."""
    names = [Path(p).stem for p in paths]
    if len(set(names)) != len(names):
        raise QuestionFileError(f"eval files must have different names (the name is the file's stem): {names}")
    return names


def run_question_evals(base_model: Path, adapter: Path, paths: tuple[Path, ...]) -> dict[str, dict[str, float]]:
    """``{stem: {"base": share answered by the base model, "adapter": share with the adapter, "questions": n}}``."""
    from training.answers import answer_questions

    results = {}
    for name, path in zip(eval_names(paths), paths):
        questions = read_questions(path)
        asked = [q.question for q in questions]
        right = {who: sum(q.answered_by(a) for q, a in zip(questions, answers)) / len(questions)
                 for who, answers in (("base", answer_questions(base_model, asked)),
                                      ("adapter", answer_questions(base_model, asked, adapter=adapter)))}
        results[name] = {**right, "questions": len(questions)}
    return results


def as_eval_results(evals: dict[str, dict[str, float]]) -> dict[str, float]:
    """The ModelVersion's ``eval_results``: ``stem`` (the adapter's share) and ``stem.base`` (the base model's)."""
    flat = {}
    for name, result in evals.items():
        flat[name], flat[f"{name}.base"] = result["adapter"], result["base"]
    return flat
