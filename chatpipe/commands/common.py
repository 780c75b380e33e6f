"""Helpers shared by the command groups: settings from flags, console output."""

from __future__ import annotations

from typing import TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings
from rich.console import Console

from schemas.errors import ChatpipeError

console = Console()
err_console = Console(stderr=True)

S = TypeVar("S", bound=BaseSettings)


class SettingsError(ChatpipeError):
    """A flag or CHATPIPE_* variable has a value the component cannot use."""


def build_settings(cls: type[S], **flags) -> S:
    """``cls`` from CHATPIPE_* environment variables, overridden by the flags that were given.

    Flags left at ``None`` fall through to the environment, then to the field's default.
    """
    try:
        return cls(**{k: v for k, v in flags.items() if v is not None})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise SettingsError(f"invalid {cls.__name__}: {problems}") from None
