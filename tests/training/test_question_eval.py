"""Question eval files (``--eval-questions``): what a line must be, how an answer is judged, and the names the
results take on a model version."""

from __future__ import annotations

import pytest

from chatpipe.testing.planted_facts import facts, held_out, write_held_out_questions
from training.question_eval import Question, QuestionFileError, as_eval_results, eval_names, read_questions


def test_the_planted_held_out_questions_read_back(tmp_path):
    path = write_held_out_questions(tmp_path / "held.jsonl", facts(2))
    assert read_questions(path) == [Question(q, f.capital) for q, f in held_out(facts(2))]


@pytest.mark.parametrize("text, error", [
    ("", "no questions"),
    ("{oops\n", ":1: not JSON"),
    ('{"question": "q", "expected": "a"}\n["q", "a"]\n', ":2: a line is"),
    ('{"question": "q", "expected": ""}\n', ":1: a line is"),
    ('{"question": "q", "expected": 3}\n', ":1: a line is"),
])
def test_a_bad_file_is_refused_with_its_line(tmp_path, text, error):
    path = tmp_path / "q.jsonl"
    path.write_text(text)
    with pytest.raises(QuestionFileError, match=error):
        read_questions(path)


def test_a_missing_file_and_two_files_of_one_name_are_refused(tmp_path):
    with pytest.raises(QuestionFileError, match="no such eval file"):
        read_questions(tmp_path / "gone.jsonl")
    with pytest.raises(QuestionFileError, match="different names"):
        eval_names((tmp_path / "a" / "capitals.jsonl", tmp_path / "b" / "capitals.jsonl"))


def test_an_answer_is_right_when_it_contains_the_expected_text_in_any_case():
    question = Question("Name the capital of Veloria.", "Quennick")
    assert question.answered_by("The capital is QUENNICK.") and not question.answered_by("It is Pelmora.")


def test_results_on_a_version_name_the_base_models_share_apart():
    evals = {"capitals": {"base": 0.0, "adapter": 0.75, "questions": 8}}
    assert as_eval_results(evals) == {"capitals": 0.75, "capitals.base": 0.0}
