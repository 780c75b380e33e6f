"""The text edge around the token-id engine: prompts to token ids (chat template), token ids back
to text increments, and stop strings.

Everything that needs the tokenizer lives here, so the engine itself stays token-ids-only.
Stop strings are matched on decoded text; text that could be the start of a stop string is held
back until it is clear, so a caller never sees half of a stop string.
"""

from __future__ import annotations

from typing import Any, Sequence

from formats.chat_tokens import encode_chat, encode_plain


def encode_prompt(tokenizer: Any, prompt: str, system: str | None = None, chat: bool = True) -> list[int]:
    """Token ids of ``prompt``: through the model's chat template (if it has one and ``chat``), the
    prompt and system texts as plain text (``chat_tokens.encode_chat``: text that looks like a
    control token is not one); ``chat=False`` (``generate --raw``) encodes the text as written,
    control tokens included: the operator writes the template by hand there."""
    if chat and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return encode_chat(tokenizer, messages)
    if chat:  # no template: the prompt is still user text
        return encode_plain(tokenizer, prompt, add_special_tokens=True)
    return list(tokenizer.encode(prompt))


class IncrementalDetokenizer:
    """Feeds token ids, returns the new text each one adds; ``flush()`` at the end of generation.

    Bounded window, the vLLM/TGI way: each token decodes only a few tokens already shown (the
    prefix, ``PREFIX_TOKENS``, giving context such as a leading space or the lead bytes of a
    character) plus the tokens not shown yet, and emits what that window's text gained. Text that
    ends in U+FFFD (a character whose bytes are not all generated yet) is held back until the
    character completes, at most ``MAX_PENDING_TOKENS`` tokens; past that the bytes are garbage
    and only the last, possibly incomplete, character is held. So each token costs O(window), not
    O(output), and the pieces joined with ``flush()`` equal ``tokenizer.decode(all ids)`` for
    byte-level BPE tokenizers (SmolLM2, Llama 3, Qwen2, GPT-2), tested on random id sequences.

    If a tokenizer's decode rewrites text already shown (clean-up steps), what was shown stays and
    the text after it still streams; the joined pieces then differ from the full decode there.
    """

    PREFIX_TOKENS = 4  # >= the 3 trailing bytes an incomplete UTF-8 character can span
    MAX_PENDING_TOKENS = 8

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix = 0  # the window is token_ids[_prefix:]
        self._read = 0  # token_ids[:_read] are shown (all but a held trailing U+FFFD when forced)
        self._shown = 0  # characters of the window's text already shown

    def push(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        text = self._decode(self._prefix)
        if not text.endswith("\ufffd"):
            return self._emit(text, hold=0)
        if len(self.token_ids) - self._read < self.MAX_PENDING_TOKENS:
            return ""  # wait for the rest of the character
        return self._emit(text, hold=1)

    def flush(self) -> str:
        """Whatever is still held back: at the end an incomplete character stays U+FFFD, as in the
        full decode."""
        text = self._decode(self._prefix)
        new, self._shown = text[self._shown :], max(self._shown, len(text))
        self._read = len(self.token_ids)
        return new

    def _emit(self, text: str, hold: int) -> str:
        new = text[self._shown : len(text) - hold]
        # Slide the window: keep a few shown tokens as context for the next ones.
        self._read = len(self.token_ids)
        self._prefix = max(0, self._read - self.PREFIX_TOKENS)
        self._shown = len(self._decode(self._prefix)) - hold
        return new

    def _decode(self, start: int) -> str:
        return self.tokenizer.decode(self.token_ids[start:], skip_special_tokens=self.skip_special_tokens)


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


class TextStream:
    """One request's text, built inside the engine's step: incremental text cut at the first stop
    string. The engine feeds it each sampled token (``Engine.add_request(..., text_stream=...)``)
    and ends the request in the same step when ``stopped`` turns true, so no token is computed
    after the one that completes a stop string; each ``TokenEvent.text`` is what is safe to show.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), skip_special_tokens: bool = True) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.matcher = StopStringMatcher(stop)

    @property
    def stopped(self) -> bool:
        return self.matcher.stopped

    def push(self, token_id: int) -> str:
        return self.matcher.feed(self.detokenizer.push(token_id))

    def finish(self) -> str:
        """At the end of generation: the held-back tail (an incomplete last character shows as
        U+FFFD, as in the full decode; text held as a possible stop-string start comes out)."""
        if self.stopped:
            return ""
        text = self.matcher.feed(self.detokenizer.flush())
        return text if self.stopped else text + self.matcher.flush()
