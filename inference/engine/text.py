"""The text edge around the token-id engine: prompts to token ids (chat template), token ids back
to text increments, and stop strings.

Everything that needs the tokenizer lives here, so the engine itself stays token-ids-only.
Stop strings are matched on decoded text; text that could be the start of a stop string is held
back until it is clear, so a caller never sees half of a stop string.
"""

from __future__ import annotations

from typing import Any, Sequence


def encode_prompt(tokenizer: Any, prompt: str, system: str | None = None, chat: bool = True) -> list[int]:
    """Token ids of ``prompt``: through the model's chat template (if it has one and ``chat``), else raw."""
    if chat and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(prompt))


class IncrementalDetokenizer:
    """Feeds token ids, returns the new text each one adds.

    Decodes the whole output each time (simple and correct for multi-token characters and
    tokenizers that merge spaces); holds back a trailing U+FFFD, i.e. a character whose bytes are
    not all generated yet.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self._emitted = ""

    def push(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        if text.endswith("\ufffd") or not text.startswith(self._emitted):
            return ""
        new, self._emitted = text[len(self._emitted) :], text
        return new


class StopStringMatcher:
    """Cuts generated text at the first stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Text that is safe to show now; sets ``stopped`` when a stop string matched."""
        if self.stopped:
            return ""
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return buf[: min(hits)]
        hold = max((k for s in self.stops for k in range(1, len(s)) if buf.endswith(s[:k])), default=0)
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        """At the end of generation the held-back text was not a stop string after all."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
