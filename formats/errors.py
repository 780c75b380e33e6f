"""The error a request format raises: under the project's root error, and a ``ValueError`` (the
engine's ``InvalidRequestError`` derives from it, so ``except FormatError`` also catches the
engine's refusals of a format)."""

from __future__ import annotations

from schemas.errors import ChatpipeError


class FormatError(ChatpipeError, ValueError):
    """A ``response_format`` or tool parameters schema that can never be enforced as given; the
    message starts with the part of the request at fault (``response_format.json_schema.schema...``).
    Retrying it will not help."""
