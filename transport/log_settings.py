"""How every service writes its log lines (``CHATPIPE_LOG_FORMAT``; transport/logs.py)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

FORMATS = ("text", "json")


class LogSettings(BaseSettings):
    """From ``CHATPIPE_LOG_*`` variables; the same in the gateway, the streams worker and the inference worker."""

    model_config = SettingsConfigDict(env_prefix="CHATPIPE_LOG_", frozen=True, extra="ignore")

    format: str = Field("text", description="text (for a person at a terminal) or json (one JSON object per line, "
                                            "with the trace_id, span_id and request_id of the span it was logged in)")

    @field_validator("format", mode="before")
    @classmethod
    def _known_format(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = value.strip().lower() or "text"
            if value not in FORMATS:
                raise ValueError(f"CHATPIPE_LOG_FORMAT={value!r}: expected one of {', '.join(FORMATS)}")
        return value
