"""One ``CHATPIPE_*`` variable, one setting: two settings classes that read the same variable agree on
its type and default (chatpipe/settings_doc.py finds every class of the project)."""

from __future__ import annotations

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from chatpipe import settings_doc


def test_every_package_is_searched_and_the_known_classes_are_found():
    names = {c.__name__ for c in settings_doc.settings_classes()}
    assert {"KafkaSettings", "GatewaySettings", "StackSettings", "ClusterSettings", "StreamsSettings",
            "WorkerSettings", "EngineSettings", "ClientSettings", "TracingSettings", "SparkSettings",
            "CapacitySettings", "MemorySettings"} <= names


def test_no_variable_has_two_defaults_or_two_types():
    problems = settings_doc.conflicts()
    assert not problems, ("variables defined by several settings classes differently (give them one default, or "
                          "different names when they mean different things):\n" + "\n".join(problems))


class _One(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CHATPIPE_TEST_")
    port: int = Field(1, description="a port")
    same: str = Field("x", description="agrees with _Two")


class _Two(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CHATPIPE_")
    port: int = Field(2, validation_alias=AliasChoices("CHATPIPE_TEST_PORT", "CHATPIPE_OLD_PORT"), description="the same port")
    test_same: str = Field("x", description="agrees with _One")
    test_kind: int = Field(0, description="an int here")


class _Three(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CHATPIPE_TEST_")
    kind: str = Field("0", description="a str there")


def test_the_check_reports_one_name_with_two_defaults_or_types():
    problems = settings_doc.conflicts([_One, _Two, _Three])
    assert len(problems) == 2, problems
    kind, port = problems
    assert kind.startswith("CHATPIPE_TEST_KIND:") and "(int, default 0)" in kind and "(str, default 0)" in kind
    assert port.startswith("CHATPIPE_TEST_PORT:") and "_One.port (int, default 1)" in port
    assert "_Two.port (int, default 2)" in port
    assert not any("CHATPIPE_TEST_SAME" in p for p in problems)  # same name, same default: one setting


def test_variable_names_follow_prefix_and_aliases():
    assert settings_doc.env_names(_One, "port") == ["CHATPIPE_TEST_PORT"]
    assert settings_doc.env_names(_Two, "port") == ["CHATPIPE_TEST_PORT", "CHATPIPE_OLD_PORT"]
