"""The pipeline's one context size (``CHATPIPE_CONTEXT_TOKENS``) as a pydantic-settings source.

The rule (one size, its deprecated aliases, their disagreement an error) is pure and lives with the
other request rules: ``schemas.requests.context_tokens_from_env`` takes a mapping. This module hands it
the environment as pydantic-settings reads it (schemas read no environment); the settings of the
gateway, streams and the engine use :func:`with_shared_context` in their ``settings_customise_sources``.
"""

from __future__ import annotations

from typing import Any

from pydantic_settings import BaseSettings, EnvSettingsSource

from schemas.requests import CONTEXT_TOKENS_ENV, DEFAULT_CONTEXT_TOKENS, DEPRECATED_CONTEXT_ENVS, context_tokens_from_env

#: ``json_schema_extra`` of a context-size field: the variables that really set it, the documented one first
#: (:class:`SharedContextTokens` reads them, ahead of the class's own prefix; chatpipe/settings_doc.py lists them).
SHARED_CONTEXT_ENV = {"env_names": [CONTEXT_TOKENS_ENV, *DEPRECATED_CONTEXT_ENVS]}


class SharedContextTokens(EnvSettingsSource):
    """A pydantic-settings source that gives ``field`` the shared context size (the default when
    none is set). Placed after the init arguments and before the environment, so an explicit
    argument wins and the component's own old variable name is read only through the alias rule."""

    def __init__(self, settings_cls: type[BaseSettings], field: str) -> None:
        super().__init__(settings_cls)  # reads the environment as every settings class does
        self.field = field

    def __call__(self) -> dict[str, Any]:
        environ = {k.upper(): v for k, v in self.env_vars.items() if v is not None}
        value = context_tokens_from_env(environ)
        return {self.field: DEFAULT_CONTEXT_TOKENS if value is None else value}


def with_shared_context(field: str, init_settings: Any, env_settings: Any, dotenv_settings: Any,
                        file_secret_settings: Any, settings_cls: type[BaseSettings]) -> tuple[Any, ...]:
    """The sources of a settings class whose ``field`` is the shared context size (for its
    ``settings_customise_sources``)."""
    return (init_settings, SharedContextTokens(settings_cls, field), env_settings, dotenv_settings,
            file_secret_settings)
