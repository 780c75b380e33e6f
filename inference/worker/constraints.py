"""``response_format`` -> one grammar matcher per choice, for the engine's ``constraint=``.

The worker's ``inference.engine.grammar.GrammarCompiler`` is made once, from the worker's own
tokenizer and the model's logits width, on the first request that asks for a format (requests
without one never import xgrammar). The compiler keeps compiled grammars in an LRU by schema, so
a repeated schema costs one matcher (its state) per choice, not a compilation; a matcher is
stateful, hence one per sequence.

The same channel carries the gateway's tool-call constraint (``{"type": "chatpipe_tool_calls", ...}``,
``schemas.requests.TOOL_CALLS_FORMAT``: tool_choice required / a named function / auto), compiled
by the same compiler (``inference.engine.grammar``, "tool calls").

A format the compiler refuses (a schema feature it cannot turn into a grammar) is the record's
fault: ``InvalidRequestError`` (answered ``invalid_request`` with a dead letter, docs/worker.md).
Compiling can take tens of milliseconds, so the worker calls ``matchers`` in a thread; the lock
keeps the compiler's cache to one caller at a time.
"""

from __future__ import annotations

import threading
from typing import Any

from inference.worker.errors import InvalidRequestError


class Constraints:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler: Any = None
        self._lock = threading.Lock()

    def matchers(self, fmt: dict, n: int = 1, max_tokens: int | None = None) -> list[Any] | None:
        """``n`` fresh matchers for ``fmt`` (OpenAI's response_format object); None for free text.
        With ``max_tokens`` (the request's) each matcher closes the JSON before the budget runs out.
        Blocking (compiles on a cache miss). Raises ``InvalidRequestError`` for a format that does
        not compile, naming the part."""
        with self._lock:
            try:
                if self._compiler is None:
                    from inference.engine.grammar import GrammarCompiler

                    self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size)
                made = [self._compiler.matcher(fmt, max_tokens) for _ in range(n)]
            except ImportError as exc:  # this worker's install lacks the grammar library
                raise InvalidRequestError(f"response_format cannot be enforced by this worker ({exc}); install "
                                          "the worker extra (xgrammar)") from None
            except (ValueError, RuntimeError) as exc:  # the engine's InvalidRequestError, xgrammar's errors
                message = str(exc)
                raise InvalidRequestError(message if message.startswith("response_format")
                                          else f"response_format: {message}") from None
        if any(m is None for m in made):  # {"type": "text"}: free text after all
            return None
        return made
