"""The scripted conversation behind ``chatpipe demo`` (the README's run command ends with it).

Shows what the pipeline does for a user in a few turns: answers streamed as they are generated,
and a fact told in the first turn recalled a few turns later (the gateway is sent only each new
message; the history comes from the streams tier). Greedy sampling and short answers, so the
small default model answers the same way every run; the phrasing below is one that
SmolLM2-135M-Instruct answers right at temperature 0.

Not here: the HTTP client and the chat loop (``clients.gateway_client``, ``clients.chat_session``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TextIO

from clients.chat_session import ChatSession, format_stats
from clients.gateway_client import Turn

FACT = "My name is Ada and my cat is called Pixel."
SCRIPT: tuple[str, ...] = (
    FACT,
    "What is the capital of France?",
    "Name three primary colors.",
    "What is my cat called?",
)
RECALL_TURN = len(SCRIPT) - 1  # index of the turn that asks about the fact
RECALL_WORD = "pixel"  # what its answer must contain (case-insensitive)
MAX_TOKENS = 48


@dataclass
class DemoResult:
    turns: list[Turn]
    recalled: bool

    @property
    def recall_answer(self) -> str:
        return self.turns[RECALL_TURN].answer.text if len(self.turns) > RECALL_TURN else ""


def run_demo(session: ChatSession, out: TextIO, script: tuple[str, ...] = SCRIPT) -> DemoResult:
    """Play ``script`` as one conversation on ``session``, streaming answers to ``out``.

    ``session.on_text`` should write to ``out`` too (the CLI's does): the answer appears token
    by token between the ``assistant>`` prefix and the stats line.
    """
    turns = []
    for i, prompt in enumerate(script, 1):
        out.write(f"\nyou> {prompt}\nassistant> ")
        out.flush()
        turn = session.ask(prompt)
        turns.append(turn)
        out.write(f"\n  turn {i} {format_stats(turn)}\n")
        out.flush()
    recalled = len(turns) > RECALL_TURN and RECALL_WORD in turns[RECALL_TURN].answer.text.lower()
    return DemoResult(turns, recalled)


def summary(result: DemoResult) -> list[str]:
    """Closing lines: the per-turn figures and whether the fact came back."""
    lines = ["", "turn  ttft (s)  tokens  tokens/s"]
    for i, t in enumerate(result.turns, 1):
        ttft = f"{t.ttft_s:.2f}" if t.ttft_s is not None else "-"
        rate = f"{t.tokens_per_s:.1f}" if t.tokens_per_s is not None else "-"
        lines.append(f"{i:>4}  {ttft:>8}  {t.answer.completion_tokens:>6}  {rate:>8}")
    if result.recalled:
        lines.append(f"recall: turn {RECALL_TURN + 1} names the cat from turn 1 ({RECALL_WORD.title()!r} is in its answer)")
    else:
        lines.append(f"recall MISSING: turn {RECALL_TURN + 1}'s answer does not contain {RECALL_WORD.title()!r}: "
                     f"{result.recall_answer!r}")
    return lines
