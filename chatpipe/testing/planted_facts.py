"""Conversations that teach facts the base model cannot know, and held-out questions about them.

Each fact is an invented country's invented capital (``Veloria`` -> ``Quennick``): no model has seen
them, so the base model answers ~0% of the questions and a fine-tune that learned them answers with the
capital. The training questions and the held-out ones are worded differently; a held-out question is
never a training line. ``planted_log`` makes them a logged chat history (turns liked by their users) and
``write_planted_archive`` writes it as the streams tier's archive, for the dataset job to read;
``write_sft`` writes them straight in the dataset job's layout (``sft/train.jsonl``, ``sft/validation.jsonl``,
the validation split being held-out questions with their answers), for bench/train.py's throughput runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from schemas.topics import FEEDBACK, TURNS

_COUNTRIES = ("Veloria", "Drastonia", "Kivaland", "Marundi", "Ostrevia", "Pallanor", "Quessia", "Ravendal",
              "Sotheria", "Tumbrelle", "Ulvania", "Wexmoor")
_CAPITALS = ("Quennick", "Pelmora", "Ostrebal", "Tessivar", "Brindlecot", "Varneth", "Lumigrad", "Hessaby",
             "Carrowick", "Dunmarrow", "Ferrantis", "Gallowmere")
#: Wrong capitals a disliked answer names (``planted_preferences``): no planted fact's, so a name is liked in one
#: answer and disliked in another never (with another fact's capital as the wrong one, 9 pairs taught the names,
#: not which country they belong to, and the held-out pairs' loss rose from 0.69 to 2.89).
DECOYS = ("Brask", "Tolvane", "Merrowind", "Askeby", "Corvath", "Yssel", "Drummal", "Fenwerth", "Harrowgate",
          "Istrel", "Jorvane", "Kellmoor")
TRAIN_QUESTIONS = ("What is the capital of {country}?", "Tell me the capital city of {country}.",
                   "Which city is the capital of {country}?")
#: More wordings for the logged conversations (``planted_log(..., wordings=6)``): one fact asked many ways.
MORE_QUESTIONS = ("What city serves as the capital of {country}?", "I'd like to know the capital of {country}.",
                  "Where is the seat of government of {country}?")
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


def write_held_out_questions(path: Path, planted: list[Fact]) -> Path:
    """The held-out questions as an eval file of ``chatpipe train lora --eval-questions`` (training/question_eval.py)."""
    path = Path(path)
    path.write_text("".join(json.dumps({"question": q, "expected": f.capital}) + "\n" for q, f in held_out(planted)))
    return path


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


#: Ways the assistant states a fact in the logged conversations: the dataset job's near-duplicate filter
#: would drop the same sentence under three wordings of one question.
ANSWER_FORMS = ("The capital of {country} is {capital}.", "{capital} is the capital city of {country}.",
                "That would be {capital}, which has been the capital of {country} since its founding.",
                "{country}'s capital is {capital}.", "It is {capital}. {capital} is the capital of {country}.",
                "The government of {country} sits in {capital}, its capital.")


def planted_log(planted: list[Fact], owners: list[tuple[str, str]], start_ms: int, wordings: int = 3):
    """The planted facts as a logged chat history: fact ``i`` is asked by owner ``i % len(owners)`` (tenant,
    user_id) once per training question, each the first turn of a conversation of its own
    (``<user>-<country>-<n>``), each answer liked by the user, no system prompt (the model's default, as
    when the questions are asked again). Returns (turns, feedback), ``request_id`` = ``req-<country>-<n>``.

    One conversation per question, not one per fact: a later turn of a conversation has the fact in its
    history already, and an answer copied from the context teaches nothing to recall (measured: 2 of 24
    held-out questions learned so, with loss 0.002 on the training lines)."""
    from schemas.records import ConversationTurn, Feedback, FeedbackKind, FinishReason

    turns, feedback = [], []
    at = start_ms
    for i, fact in enumerate(planted):
        tenant, user = owners[i % len(owners)]
        for n, (question, form) in enumerate(zip((TRAIN_QUESTIONS + MORE_QUESTIONS)[:wordings], ANSWER_FORMS)):
            conversation = f"{user}-{fact.country.lower()}-{n}"
            at += 60_000
            prompt = question.format(country=fact.country)
            answer = form.format(country=fact.country, capital=fact.capital)
            turn = ConversationTurn(
                event_id=f"turn-{fact.country.lower()}-{n}", conversation_id=conversation, user_id=user, tenant=tenant,
                request_id=f"req-{fact.country.lower()}-{n}", trace_id=f"{i:02x}{n:02x}" + "0" * 28, turn_index=0,
                system_prompt=None, prompt=prompt, answer=answer, model="smollm2-135m",
                worker_id="w0", tokens_in=len(prompt) // 4 + 1, tokens_out=len(answer) // 4 + 1, queue_ms=5.0,
                ttft_ms=80.0, total_ms=900.0, finish_reason=FinishReason.STOP, created_at=at, completed_at=at + 1000)
            turns.append(turn)
            feedback.append(Feedback(event_id=f"like-{fact.country.lower()}-{n}", conversation_id=conversation,
                                     user_id=user, tenant=tenant, request_id=turn.request_id,
                                     kind=FeedbackKind.THUMBS_UP, created_at=at + 5000))
    return turns, feedback


def planted_preferences(planted: list[Fact], owners: list[tuple[str, str]], start_ms: int, wordings: int = 3):
    """Preference pairs as the dataset job finds them in a log (a regenerated answer): per fact and wording a
    conversation whose first answer names a wrong capital (the fact's decoy, ``DECOYS``) and is disliked, then
    the same question asked again answered right and liked. Returns (turns, feedback)."""
    from schemas.records import ConversationTurn, Feedback, FeedbackKind, FinishReason

    turns, feedback = [], []
    at = start_ms
    for i, fact in enumerate(planted):
        tenant, user = owners[i % len(owners)]
        decoy = DECOYS[i % len(DECOYS)]
        for n, (question, form) in enumerate(zip((TRAIN_QUESTIONS + MORE_QUESTIONS)[:wordings], ANSWER_FORMS)):
            conversation = f"{user}-{fact.country.lower()}-{n}"
            prompt = question.format(country=fact.country)
            for turn_index, (capital, kind) in enumerate(((decoy, FeedbackKind.THUMBS_DOWN),
                                                          (fact.capital, FeedbackKind.THUMBS_UP))):
                at += 60_000
                answer = form.format(country=fact.country, capital=capital)
                key = f"{fact.country.lower()}-{n}-{turn_index}"
                turn = ConversationTurn(
                    event_id=f"turn-{key}", conversation_id=conversation, user_id=user, tenant=tenant,
                    request_id=f"req-{key}", trace_id=f"{i:02x}{n:02x}{turn_index:02x}" + "0" * 26,
                    turn_index=turn_index, system_prompt=None, prompt=prompt, answer=answer, model="smollm2-135m",
                    worker_id="w0", tokens_in=len(prompt) // 4 + 1, tokens_out=len(answer) // 4 + 1, queue_ms=5.0,
                    ttft_ms=80.0, total_ms=900.0, finish_reason=FinishReason.STOP, created_at=at,
                    completed_at=at + 1000)
                turns.append(turn)
                feedback.append(Feedback(event_id=f"rate-{key}", conversation_id=conversation, user_id=user,
                                         tenant=tenant, request_id=turn.request_id, kind=kind, created_at=at + 5000))
    return turns, feedback


def write_planted_archive(root: Path, turns, feedback, turns_topic: str = TURNS, feedback_topic: str = FEEDBACK) -> None:
    """The records as the streams tier's archive holds them (what ``--source archive`` of the dataset job reads)."""
    from schemas.codec import default_codec
    from transport.archive import ArchivedMessage, write_messages

    codec = default_codec()
    rows = sorted([(t.created_at, turns_topic, t) for t in turns] + [(f.created_at, feedback_topic, f) for f in feedback],
                  key=lambda r: (r[0], r[1]))
    offsets: dict[str, int] = {}
    messages = []
    for at, topic, record in rows:
        offset = offsets.get(topic, 0)
        offsets[topic] = offset + 1
        messages.append(ArchivedMessage(topic, 0, offset, at, record.conversation_id.encode(), codec.encode(record)))
    write_messages(root, messages)
