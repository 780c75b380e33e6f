"""Each token's own text and UTF-8 bytes, for logprobs (TokenChunk v3 ``TokenLogprob``).

A token of a byte-level BPE vocabulary (GPT-2, Llama 3, SmolLM2) can hold part of a UTF-8
character: "😀" is two tokens of the default model, and decoding either one alone gives U+FFFD.
OpenAI's ``bytes`` field is the token's real bytes, so a client can join them back into the text.
They come from the token's vocabulary string (``convert_ids_to_tokens``) through the inverse of
the byte-level alphabet (GPT-2's ``bytes_to_unicode``), the way the tokenizer's own ``ByteLevel``
decoder does it; SentencePiece byte-fallback tokens (``<0xE2>``) and its "▁" space are handled
too. Special tokens (``<|im_end|>``) are their content. The ``token`` text is the bytes decoded
with replacement characters (what vLLM shows).

The tables are built once per tokenizer and the results cached per token id: the worker asks for
every generated token when logprobs are on, and for top_logprobs alternatives as well.
"""

from __future__ import annotations

import json
import re
import threading
from functools import lru_cache
from typing import Any

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPIECE_SPACE = "\u2581"  # "▁"


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character standing for each byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes)}


def _decoder_types(tokenizer: Any) -> set[str]:
    """The types of the fast tokenizer's decoder and of every decoder nested in it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return {"ByteLevel"} if hasattr(tokenizer, "byte_decoder") else set()
    try:
        spec = json.loads(backend.to_str()).get("decoder") or {}
    except Exception:  # noqa: BLE001 - an exotic tokenizer: fall back to decode() per token
        return set()
    types: set[str] = set()
    stack = [spec]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "type" in node:
                types.add(node["type"])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return types


class TokenBytes:
    """``text(id)`` and ``bytes(id)`` of single tokens of one tokenizer (thread-safe cache)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        types = _decoder_types(tokenizer)
        self.byte_level = "ByteLevel" in types
        self.byte_fallback = "ByteFallback" in types
        self.spiece = "Replace" in types or "Metaspace" in types
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.added = {int(i): str(getattr(t, "content", t)) for i, t in added.items()}
        self._cache: dict[int, tuple[str, bytes]] = {}
        self._lock = threading.Lock()

    def of(self, token_id: int) -> tuple[str, bytes]:
        """(text, UTF-8 bytes) of one token."""
        got = self._cache.get(token_id)
        if got is None:
            raw = self._bytes(token_id)
            got = (raw.decode("utf-8", errors="replace"), raw)
            with self._lock:
                self._cache[token_id] = got
        return got

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str) or not (self.byte_level or self.byte_fallback or self.spiece):
            return self.tokenizer.decode([token_id]).encode("utf-8")
        if self.byte_fallback and (m := _BYTE_FALLBACK.fullmatch(piece)):
            return bytes([int(m.group(1), 16)])
        if self.spiece:
            piece = piece.replace(_SPIECE_SPACE, " ")
        if not self.byte_level:
            return piece.encode("utf-8")
        table = byte_decoder()
        out = bytearray()
        for ch in piece:
            b = table.get(ch)
            if b is None:
                out += ch.encode("utf-8")
            else:
                out.append(b)
        return bytes(out)
