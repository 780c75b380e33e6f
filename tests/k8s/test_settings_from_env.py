"""``k8s.common.settings_from_env``: a service's settings from the variables its container gets, and from
nothing else (the renderer's own environment never reaches a manifest), without touching os.environ."""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from inference.engine.settings import EngineSettings
from inference.worker.settings import WorkerSettings
from k8s.common import settings_from_env
from transport.settings import KafkaSettings


def test_the_process_environment_is_not_read(monkeypatch):
    monkeypatch.setenv("CHATPIPE_MAX_BATCH", "3")
    monkeypatch.setenv("CHATPIPE_CONTEXT_TOKENS", "999")
    monkeypatch.setenv("CHATPIPE_WORKER_GROUP_ID", "from-the-shell")
    before = dict(os.environ)
    engine = settings_from_env(EngineSettings, {})
    assert type(engine) is EngineSettings
    assert (engine.max_batch, engine.max_seq_len) == (16, 2048)
    assert settings_from_env(WorkerSettings, {}).group_id == "chatpipe-inference"
    assert dict(os.environ) == before


def test_the_mapping_then_the_init_values_are_read():
    engine = settings_from_env(EngineSettings, {"CHATPIPE_MAX_BATCH": "5", "CHATPIPE_CONTEXT_TOKENS": "4096"})
    assert (engine.max_batch, engine.max_seq_len) == (5, 4096)  # the shared context size too
    kafka = settings_from_env(KafkaSettings, {"CHATPIPE_TOPIC_PREFIX": "env."}, topic_prefix="init.")
    assert kafka.topic_prefix == "init."


def test_a_bad_value_names_the_class():
    with pytest.raises(ValidationError, match="EngineSettings"):
        settings_from_env(EngineSettings, {"CHATPIPE_MAX_BATCH": "0"})
