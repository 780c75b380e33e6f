"""Named errors of the engine: one root under the project's root error, each with a message a user
can act on.

``Engine.add_request`` answers a refusal for lack of room as an ``Admission`` result (see
``request.py``), not an exception; ``RequestRefused`` is that result turned into an error by the
callers that cannot go on without an answer (``stream_text``, ``Engine.generate``, the CLI).
Several errors also derive from the builtin they replaced (``ValueError``, ``RuntimeError``), so
callers written against the old behaviour keep working.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from schemas.errors import ChatpipeError

if TYPE_CHECKING:
    from inference.engine.request import Admission


class EngineError(ChatpipeError):
    """Root of every error the engine raises on purpose."""


class ModelNotFoundError(EngineError):
    """The model folder or file is not where the settings say (e.g. `chatpipe model pull` not run)."""


class ModelLoadError(EngineError):
    """The model files exist but cannot be read (corrupt, truncated, wrong format)."""


class ModelPullError(EngineError):
    """Fetching or converting the default model failed (no network to PyPI, pip failed, bad wheel)."""


class UnsupportedModelError(EngineError):
    """The model loaded, but its architecture is not one the engine's forward pass implements."""


class DeviceUnavailableError(EngineError):
    """The settings name a device this machine cannot run on (no GPU, unknown device type)."""


class InvalidRequestError(EngineError, ValueError):
    """A request the engine can never run as given: empty prompt, token ids outside the vocabulary,
    a request id already in use, sampling parameters out of range, a ``response_format`` the
    grammar compiler cannot enforce (``grammar.GrammarCompiler`` raises it with the message of the
    pure check's ``formats.errors.FormatError``). Retrying it will not help."""


class RequestRefused(EngineError, RuntimeError):
    """The engine did not accept a request (``admission`` says why: TOO_LARGE or OVERLOADED).

    Carries the numbers a caller needs for a reply or a dead letter: the prompt's token count, the
    new tokens asked for, and the limit that was hit (tokens per request for TOO_LARGE, the
    waiting-queue bound for OVERLOADED).
    """

    def __init__(self, admission: Admission, num_prompt_tokens: int, max_new_tokens: int, limit: int) -> None:
        self.admission = admission
        self.num_prompt_tokens = num_prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.limit = limit
        if admission.value == "too_large":
            message = (
                f"request refused (too_large): {num_prompt_tokens} prompt tokens + {max_new_tokens} new tokens "
                f"= {num_prompt_tokens + max_new_tokens}, over the {limit}-token limit per request "
                "(the smaller of max_seq_len and the KV cache); shorten the prompt or ask for fewer new tokens"
            )
        else:
            message = f"request refused ({admission.value}): the waiting queue is full ({limit} requests); retry later"
        super().__init__(message)

    def __reduce__(self):  # picklable with its fields (multiprocessing, logging handlers)
        return type(self), (self.admission, self.num_prompt_tokens, self.max_new_tokens, self.limit)


class EngineFailed(EngineError):
    """The engine's step loop raised; the engine is stopped and every open and later request fails
    with this error (its ``__cause__`` is the original exception). Build a new engine to go on."""


class EngineStopped(EngineError):
    """``AsyncEngine.stop()`` was called while the request was open (or before it was submitted):
    the generation did not finish and its cache was released."""
