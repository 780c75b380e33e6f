"""Settings of the gateway clients (``chatpipe chat``, ``chatpipe demo``), and where the API key comes from.

Built once by the CLI from flags and ``CHATPIPE_*`` variables (``CHATPIPE_GATEWAY_URL``,
``CHATPIPE_API_KEY``, ``CHATPIPE_STATE_DIR``, ``CHATPIPE_CHAT_MODEL``, ...), then passed in.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.errors import ChatpipeError


class ApiKeyError(ChatpipeError):
    """No API key to be found, or a keys file that cannot be read."""


class ClientSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CHATPIPE_", frozen=True, extra="ignore")

    gateway_url: str = Field("http://127.0.0.1:8000", description="Base URL of the gateway")
    api_key: str | None = Field(None, description="Bearer key; default: first key of <state_dir>/gateway/keys.json")
    state_dir: Path = Field(Path(".chatpipe"), description="State folder of the local stack (`chatpipe up`)")
    chat_model: str | None = Field(None, description="Model id; default: the first one /v1/models lists")
    chat_max_tokens: int = Field(256, gt=0, description="Most new tokens per answer")
    chat_temperature: float = Field(0.7, ge=0, description="Sampling temperature; 0 = greedy")
    chat_timeout_s: float = Field(300.0, gt=0, description="Longest wait for the next bytes of an answer")

    @property
    def keys_file(self) -> Path:
        return self.state_dir / "gateway" / "keys.json"

    @model_validator(mode="after")
    def _gateway_of_the_local_stack(self) -> "ClientSettings":
        """Without --url / CHATPIPE_GATEWAY_URL, the gateway the state folder's stack was started with
        (``chatpipe up --gateway-port`` saves it in ``<state_dir>/stack.json``), so a stack on another
        port is found as ``status`` finds it."""
        if "gateway_url" in self.model_fields_set:
            return self
        try:
            saved = json.loads((self.state_dir / "stack.json").read_text())["settings"]
            url = f"http://{saved['host']}:{int(saved['gateway_port'])}"
        except (OSError, ValueError, KeyError, TypeError):
            return self  # no stack saved there (or not readable): the default URL
        object.__setattr__(self, "gateway_url", url)  # frozen model: set once, while validating
        return self


def find_api_key(settings: ClientSettings) -> str:
    """``settings.api_key`` (flag or CHATPIPE_API_KEY), else the first key of the local stack's keys file."""
    if settings.api_key:
        return settings.api_key
    path = settings.keys_file
    if not path.is_file():
        raise ApiKeyError(f"no API key: pass --api-key, set CHATPIPE_API_KEY, or start the stack with "
                          f"`chatpipe up` (it writes {path})")
    try:
        keys = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ApiKeyError(f"cannot read the keys file {path}: {exc}") from exc
    if not isinstance(keys, dict) or not keys:
        raise ApiKeyError(f"the keys file {path} holds no keys (expected {{\"<key>\": {{\"tenant\": ...}}}})")
    return next(iter(keys))
