"""Named errors of the engine: one root, each with a message a user can act on.

Refusing a request for lack of room is *not* an error: admission returns an ``Admission`` result
(see ``request.py``); these exceptions are for bad inputs at the engine's boundary (model files,
model architectures, arguments).
"""

from __future__ import annotations


class EngineError(Exception):
    """Root of every error the engine raises on purpose."""


class ModelNotFoundError(EngineError):
    """The model folder or file is not where the settings say (e.g. `chatpipe model pull` not run)."""


class ModelLoadError(EngineError):
    """The model files exist but cannot be read (corrupt, truncated, wrong format)."""


class ModelPullError(EngineError):
    """Fetching or converting the default model failed (no network to PyPI, pip failed, bad wheel)."""


class UnsupportedModelError(EngineError):
    """The model loaded, but its architecture is not one the engine's forward pass implements."""
