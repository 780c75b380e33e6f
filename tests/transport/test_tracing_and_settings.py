"""W3C traceparent handling and settings precedence (flags over CHATPIPE_* env over defaults)."""

from __future__ import annotations

import pytest

from chatpipe.commands.common import SettingsError, build_settings
from transport import tracing
from transport.settings import KafkaSettings


def test_child_keeps_trace_id_and_changes_span():
    """A hop must continue the caller's trace, not start a new one."""
    parent = tracing.new_traceparent()
    child = tracing.child_traceparent(parent)
    assert tracing.trace_id(child) == tracing.trace_id(parent)
    assert child.split("-")[2] != parent.split("-")[2]


@pytest.mark.parametrize("bad", [None, "", "garbage", "00-" + "0" * 32 + "-" + "1" * 16 + "-01"])
def test_invalid_parent_starts_a_new_trace(bad):
    """A missing or invalid (all-zero) traceparent must yield a fresh valid one, never be copied."""
    child = tracing.child_traceparent(bad)
    assert tracing.trace_id(child) not in (None, "0" * 32)


def test_existing_traceparent_header_is_kept():
    """with_traceparent must not overwrite a header the caller already set."""
    headers = [("traceparent", b"00-" + b"a" * 32 + b"-" + b"b" * 16 + b"-01")]
    assert tracing.with_traceparent(headers) == headers
    assert tracing.find(tracing.with_traceparent([("x", b"1")])) is not None


def test_flags_override_env_and_env_overrides_defaults(monkeypatch):
    """Settings precedence: an explicit flag beats CHATPIPE_*, which beats the default."""
    monkeypatch.setenv("CHATPIPE_BOOTSTRAP_SERVERS", "envhost:1")
    monkeypatch.setenv("CHATPIPE_TOPIC_PREFIX", "env.")
    s = build_settings(KafkaSettings, bootstrap_servers="flaghost:2", topic_prefix=None)
    assert s.bootstrap_servers == "flaghost:2" and s.topic_prefix == "env."
    assert s.topic("chat.turns") == "env.chat.turns"
    monkeypatch.delenv("CHATPIPE_BOOTSTRAP_SERVERS")
    assert build_settings(KafkaSettings).bootstrap_servers == "127.0.0.1:9092"


def test_bad_setting_is_a_named_error(monkeypatch):
    """A bad CHATPIPE_* value must produce an actionable SettingsError naming the field."""
    monkeypatch.setenv("CHATPIPE_DELIVERY_TIMEOUT_S", "-3")
    with pytest.raises(SettingsError, match="delivery_timeout_s"):
        build_settings(KafkaSettings)


def test_settings_are_frozen():
    """Settings are built once and passed around; nobody may mutate them on the way."""
    s = KafkaSettings()
    with pytest.raises(Exception):
        s.bootstrap_servers = "x:1"
