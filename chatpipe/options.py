"""Command-line flags made from settings fields: one source for a flag's name, default and help.

``option(GatewaySettings, "port")`` is the ``typer.Option`` of ``--port``: its help is the field's
``description`` followed by ``[env CHATPIPE_GATEWAY_PORT; default 8000]`` (the variable and default
of the field, chatpipe/settings_doc.py), shown however the field changes. The flag's Python default
is ``None``: the command passes every flag to ``build_settings`` (chatpipe/commands/common.py), which
drops the ``None`` ones, so a flag wins over the variable, which wins over the field's default::

    def gateway(port: Annotated[Optional[int], option(GatewaySettings, "port")] = None): ...
        settings = build_settings(GatewaySettings, port=port)
"""

from __future__ import annotations

from typing import Any

import typer
from pydantic_settings import BaseSettings

from chatpipe.settings_doc import default_text, env_names


def option(cls: type[BaseSettings], field: str, *flags: str, help: str | None = None, **kwargs: Any) -> Any:
    """The ``typer.Option`` of ``cls.field``: ``flags`` (default ``--field-name``), and as help ``help``
    (default: the field's description) followed by ``[env NAME; default VALUE]``. ``help`` replaces the
    description where the command says more; extra ``kwargs`` go to ``typer.Option`` (``min``, ``hidden``, ...)."""
    # KeyError: a flag for a field the class lacks fails at import
    text = " ".join((help or cls.model_fields[field].description or "").split())
    tail = [f"env {env_names(cls, field)[0]}"]
    default = default_text(cls, field)
    if default not in ("", "(none)", "(empty)"):
        tail.append(f"default {default}")
    names = flags or (f"--{field.replace('_', '-')}",)
    return typer.Option(*names, help=f"{text} [{'; '.join(tail)}]", **kwargs)
