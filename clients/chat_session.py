"""The conversation loop of ``chatpipe chat``: one conversation with the gateway, and its commands.

A :class:`ChatSession` holds what the terminal needs to continue a conversation: its id (the
gateway's ``X-Chatpipe-Conversation-Id``; only the new user message is sent each turn, the
streams tier keeps the history) and the last prompt and answer, which the feedback commands
refer to. :func:`run_chat` reads lines (a TTY prompt or stdin, one message per line) and
dispatches them; what it prints is the transcript: streamed answers on ``out``, a short stats
line and errors (one line each, never a traceback) on ``err``.

Commands: ``/up`` ``/down`` (thumbs on the last answer), ``/regen`` (regenerate feedback, then
the same prompt again), ``/edit <text>`` (the answer as it should have been), ``/new`` (a new
conversation), ``/quit``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterable, TextIO

from clients.gateway_client import FeedbackKindName, GatewayClient, GatewayError, Turn
from schemas.errors import ChatpipeError

HELP = "commands: /up /down /regen /edit <text> /new /quit"


class ChatCommandError(ChatpipeError):
    """A command that cannot run now (no answer yet to rate) or is unknown."""


@dataclass(frozen=True, slots=True)
class Command:
    name: str  # up | down | regen | edit | new | quit | help
    arg: str = ""


_COMMANDS = {"up", "down", "regen", "edit", "new", "quit", "exit", "help"}


def parse_command(line: str) -> Command | None:
    """The command on ``line``, or None when the line is a message for the model."""
    text = line.strip()
    if not text.startswith("/") or text.startswith("//"):
        return None
    name, _, arg = text[1:].partition(" ")
    name = name.lower()
    if name not in _COMMANDS:
        raise ChatCommandError(f"unknown command /{name}; {HELP} (start a message with // to send a literal /)")
    if name == "edit" and not arg.strip():
        raise ChatCommandError("/edit needs the corrected answer: /edit <text>")
    return Command("quit" if name == "exit" else name, arg.strip())


def message_text(line: str) -> str:
    """A message line as sent: a leading ``//`` stands for a literal ``/``."""
    text = line.strip()
    return text[1:] if text.startswith("//") else text


class ChatSession:
    def __init__(self, client: GatewayClient, *, model: str, max_tokens: int, temperature: float,
                 on_text: Callable[[str], None] = lambda _: None) -> None:
        self.client = client
        self.model = model
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.on_text = on_text
        self.conversation_id: str | None = None
        self.last_prompt: str | None = None
        self.last_turn: Turn | None = None

    def ask(self, prompt: str) -> Turn:
        """Send ``prompt`` as the next user message of the conversation and stream the answer."""
        turn = self.client.stream_chat([{"role": "user", "content": prompt}], model=self.model,
                                       conversation_id=self.conversation_id, max_tokens=self.max_tokens,
                                       temperature=self.temperature, on_text=self.on_text)
        self.conversation_id = turn.conversation_id or self.conversation_id
        self.last_prompt, self.last_turn = prompt, turn
        return turn

    def feedback(self, kind: FeedbackKindName, edited_text: str | None = None) -> str:
        """Feedback of ``kind`` on the last answer; returns the event id."""
        turn = self.last_turn
        if turn is None or not turn.request_id or not self.conversation_id:
            raise ChatCommandError("no answer yet to give feedback on")
        return self.client.send_feedback(request_id=turn.request_id, conversation_id=self.conversation_id,
                                         kind=kind, edited_text=edited_text)

    def regenerate(self) -> Turn:
        """Mark the last answer as regenerated, then ask the same prompt again."""
        if self.last_prompt is None:
            raise ChatCommandError("nothing to regenerate yet")
        self.feedback("regenerate")
        return self.ask(self.last_prompt)

    def new_conversation(self) -> None:
        self.conversation_id = self.last_prompt = self.last_turn = None


def format_stats(turn: Turn) -> str:
    """``[ttft 0.41 s · 23 tokens · 15.2 tokens/s · stop]``"""
    parts = [f"ttft {turn.ttft_s:.2f} s" if turn.ttft_s is not None else "no text",
             f"{turn.answer.completion_tokens} tokens"]
    if turn.tokens_per_s is not None:
        parts.append(f"{turn.tokens_per_s:.1f} tokens/s")
    if turn.answer.finish_reason and turn.answer.finish_reason != "stop":
        parts.append(f"finish: {turn.answer.finish_reason}")
    return "[" + " · ".join(parts) + "]"


def run_chat(session: ChatSession, lines: Iterable[str], *, out: TextIO, err: TextIO, echo: bool) -> int:
    """Dispatch ``lines`` until they end or ``/quit``; returns the number of failed lines.

    ``echo`` prints each input line as ``you> ...`` (for stdin that is not a terminal, so the
    output reads as a transcript). A Ctrl-C while an answer streams stops that answer (the
    gateway cancels the generation) and the chat goes on; at the prompt it ends the chat.
    """
    failures = 0

    def answer(action: Callable[[], Turn]) -> None:
        out.write("assistant> ")
        out.flush()
        turn = None
        try:
            with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C stops this answer; the chat goes on
                turn = action()
        finally:
            out.write("\n")  # end the "assistant> " line before the stats or error line
            out.flush()
        err.write("(answer cancelled)\n" if turn is None else format_stats(turn) + "\n")

    for line in lines:
        if not line.strip():
            continue
        if echo:
            out.write(f"you> {line.rstrip()}\n")
        try:
            command = parse_command(line)
            if command is None:
                answer(lambda: session.ask(message_text(line)))
            elif command.name == "quit":
                break
            elif command.name == "help":
                err.write(HELP + "\n")
            elif command.name == "new":
                session.new_conversation()
                err.write("(new conversation)\n")
            elif command.name in ("up", "down"):
                session.feedback("thumbs_up" if command.name == "up" else "thumbs_down")
                err.write(f"(thumbs {command.name} sent)\n")
            elif command.name == "edit":
                session.feedback("edit", edited_text=command.arg)
                err.write("(edit sent)\n")
            elif command.name == "regen":
                answer(session.regenerate)
        except (GatewayError, ChatCommandError) as exc:
            err.write(f"error: {' '.join(str(exc).split())}\n")
            failures += 1
        err.flush()
    return failures

