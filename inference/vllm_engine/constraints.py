"""``response_format`` (and the gateway's tool-call constraint) -> vLLM's structured outputs.

The same grammar our engine enforces (``inference.engine.grammar.grammar_of``: the same JSON-schema
checks, separators, strictness and tool-call shapes), handed to vLLM as EBNF text
(``StructuredOutputsParams(grammar=...)``), which its xgrammar backend compiles and caches. So a
schema our engine refuses is refused here with the same message, and a schema both accept constrains
both to the same language. What our engine adds and this one does not: closing the JSON before
``max_tokens`` runs out (``grammar.BudgetedMatcher``); a vLLM answer cut by max_tokens is cut JSON,
as OpenAI's is.

The worker calls ``matchers`` as it calls ``inference.worker.constraints.Constraints.matchers``: one
constraint per choice (a ``StructuredOutputsParams`` is not stateful, so the same one serves all).
"""

from __future__ import annotations

import collections
import threading
from typing import Any

from inference.engine.errors import InvalidRequestError as EngineInvalidRequest
from inference.engine.grammar import grammar_of
from formats.response_format import DEFAULT_CACHE_SIZE, canonical


class VllmConstraints:
    """Response formats -> ``StructuredOutputsParams``; an LRU of the EBNF by canonical format text."""

    def __init__(self, invalid: type[Exception]) -> None:
        self.invalid = invalid  # the caller's error for a format that does not compile (the record's fault)
        self._ebnf: collections.OrderedDict[str, str | None] = collections.OrderedDict()
        self._lock = threading.Lock()

    def matchers(self, fmt: dict, n: int = 1, max_tokens: int | None = None) -> list[Any] | None:
        """``n`` constraints for ``fmt`` (None for free text). Raises ``invalid`` naming the part of
        the format that cannot be enforced."""
        from vllm.sampling_params import StructuredOutputsParams

        ebnf = self._grammar(fmt)
        if ebnf is None:
            return None
        return [StructuredOutputsParams(grammar=ebnf)] * n

    def _grammar(self, fmt: dict) -> str | None:
        key = canonical(fmt)
        with self._lock:
            if key in self._ebnf:
                self._ebnf.move_to_end(key)
                return self._ebnf[key]
        try:
            grammar = grammar_of(fmt)
        except (EngineInvalidRequest, ValueError, RuntimeError) as exc:
            message = str(exc)
            raise self.invalid(message if message.startswith("response_format")
                               else f"response_format: {message}") from None
        ebnf = None if grammar is None else str(grammar)
        with self._lock:
            self._ebnf[key] = ebnf
            while len(self._ebnf) > DEFAULT_CACHE_SIZE:
                self._ebnf.popitem(last=False)
        return ebnf
