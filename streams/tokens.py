"""Token counting with the chat model's own tokenizer, for context budgets and batch bounds.

``TokenCounter`` wraps any ``encode(text) -> token ids`` callable, so tests can inject a trivial
one; ``TokenCounter.for_tokenizer`` builds it from a Hugging Face tokenizer and measures what
the chat template adds around each message, so a context can be sized by adding per-message
counts (one batched tokenizer call per intake batch) and checked exactly once at the end
(``prompt_tokens``, the templated prompt as the inference worker will build it).

Counted the way the worker tokenizes (``formats.chat_tokens``, a pure-Python module,
no torch): message contents as plain text (a control-token look-alike is ordinary tokens), the
template's markup with its control tokens, so the budget here is the prompt the engine gets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from formats.chat_tokens import encode_chat
from schemas.records import ChatMessage
from streams.errors import TokenizerNotFoundError

Encode = Callable[[str], Sequence[int]]
EncodeMany = Callable[[list[str]], list[Sequence[int]]]
EncodeChat = Callable[[Sequence[ChatMessage]], Sequence[int]]

_CACHE_LIMIT = 50_000  # texts whose count is kept; recent turns recur in every prompt of a conversation


class TokenCounter:
    def __init__(self, encode: Encode, *, message_overhead: int = 0, prompt_overhead: int = 0,
                 encode_chat: EncodeChat | None = None, encode_many: EncodeMany | None = None) -> None:
        self._encode = encode
        self._encode_many = encode_many
        self.message_overhead = message_overhead  # template tokens around one message
        self.prompt_overhead = prompt_overhead  # template tokens once per prompt (BOS, generation prompt)
        self._encode_chat = encode_chat  # the whole templated prompt, as the worker builds it
        self._cache: dict[str, int] = {}

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> "TokenCounter":
        """A counter for a Hugging Face tokenizer, with its chat template's overheads measured."""
        def encode(text: str) -> list[int]:  # message content: plain text, never a control token
            return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)

        def encode_many(texts: list[str]) -> list[list[int]]:
            return tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]

        if not getattr(tokenizer, "chat_template", None):
            return cls(encode, encode_many=encode_many)

        def chat(messages: Sequence[ChatMessage]) -> list[int]:
            return encode_chat(tokenizer, [{"role": m.role, "content": m.content} for m in messages])

        def templated(messages: list[dict], generation: bool) -> int:
            return len(encode_chat(tokenizer, messages, add_generation_prompt=generation))

        system = [{"role": "system", "content": "hello"}]
        both = system + [{"role": "user", "content": "world"}]
        per_message = templated(both, False) - templated(system, False) - len(encode("world"))
        first = templated(system, False) - len(encode("hello"))
        generation = templated(both, True) - templated(both, False)
        return cls(encode, encode_many=encode_many, encode_chat=chat, message_overhead=max(per_message, 0),
                   prompt_overhead=max(first - per_message, 0) + max(generation, 0))

    def text_tokens(self, texts: Sequence[str]) -> list[int]:
        """Token count of each text (no template), one batched tokenizer call for the uncached ones."""
        missing = [t for t in dict.fromkeys(texts) if t not in self._cache]
        if missing:
            if len(self._cache) + len(missing) > _CACHE_LIMIT:
                self._cache.clear()
            ids = self._encode_many(missing) if self._encode_many else [self._encode(t) for t in missing]
            self._cache.update(zip(missing, map(len, ids)))
        return [self._cache[t] for t in texts]

    def message_tokens(self, messages: Sequence[ChatMessage]) -> list[int]:
        """What each message adds to a templated prompt (content + template overhead)."""
        return [n + self.message_overhead for n in self.text_tokens([m.content for m in messages])]

    def prompt_tokens(self, messages: Sequence[ChatMessage]) -> int:
        """Exact token count of ``messages`` as the model will see them (template included)."""
        if self._encode_chat is None:
            return self.prompt_overhead + sum(self.message_tokens(messages))
        return len(self._encode_chat(messages))


def load_chat_tokenizer(folder: Path) -> Any:
    """The chat model's tokenizer from a local model folder (never the network)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise TokenizerNotFoundError(
            f"no chat-model tokenizer in {folder}: {exc}. Run `chatpipe model pull` or set "
            "CHATPIPE_STREAMS_TOKENIZER_PATH to a Hugging Face model folder") from exc
