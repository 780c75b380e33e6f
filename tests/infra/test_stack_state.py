"""What a state folder remembers (``infra.stack_state``) and the gateway key ``up`` writes
(``infra.local_keys``): plain files, no services."""

from __future__ import annotations

import json
import stat

import pytest

from infra import stack_state
from infra.local_keys import KeysFileError, ensure_keys_file
from infra.settings import StackSettings


def test_saved_ports_fill_in_what_no_flag_sets(tmp_path):
    """Settings not given again must come from stack.json (status once used the defaults)."""
    stack_state.save(StackSettings(state_dir=tmp_path, kafka_port=19092, gateway_port=18000), ["kafka"])
    merged, services = stack_state.resolve(StackSettings(state_dir=tmp_path), running=set())
    assert (merged.kafka_port, merged.gateway_port, services) == (19092, 18000, ["kafka"])


def test_a_flag_wins_over_the_saved_value_while_that_service_is_stopped(tmp_path):
    """A stopped stack may move: the given port wins (and `up` saves it)."""
    stack_state.save(StackSettings(state_dir=tmp_path, kafka_port=19092, gateway_port=18000), ["kafka"])
    merged, _ = stack_state.resolve(StackSettings(state_dir=tmp_path, gateway_port=18001), running={"kafka"})
    assert (merged.kafka_port, merged.gateway_port) == (19092, 18001)


def test_a_flag_against_a_running_service_is_an_error(tmp_path):
    """The broker runs on 19092: asking for 19093 must be refused, naming the setting and both values."""
    stack_state.save(StackSettings(state_dir=tmp_path, kafka_port=19092), ["kafka"])
    with pytest.raises(stack_state.StackStateError, match=r"kafka_port=19093.*19092"):
        stack_state.resolve(StackSettings(state_dir=tmp_path, kafka_port=19093), running={"kafka"})


def test_an_unreadable_state_file_is_a_named_error(tmp_path):
    """A truncated stack.json must say which file and what to do, not raise a JSON traceback."""
    (tmp_path / "stack.json").write_text('{"settings": {"kafka_port"')
    with pytest.raises(stack_state.StackStateError, match="stack.json cannot be read"):
        stack_state.resolve(StackSettings(state_dir=tmp_path), running=set())


def test_keys_file_is_created_once_private_with_a_local_key(tmp_path):
    """`up` writes one multi-user sk-local- key of tenant `local`, mode 0600, and never rewrites the file;
    the gateway reads it as a key that may name users and binds nobody."""
    path = tmp_path / "gateway" / "keys.json"
    key, created = ensure_keys_file(path)
    assert created and key.startswith("sk-local-") and len(key) > 30
    assert json.loads(path.read_text()) == {key: {"tenant": "local", "users": "any"}}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again, created_again = ensure_keys_file(path)
    assert (again, created_again) == (key, False)
    from gateway.keys import KeyStore, resolve_user

    local = KeyStore.load(path).lookup(f"Bearer {key}")
    assert local.tenant == "local" and local.multi_user and not local.bound
    assert resolve_user(local, None).identified is False
    assert resolve_user(local, "ada").user_id == f"{local.namespace}:ada"


def test_an_empty_keys_file_is_a_named_error(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text("{}")
    with pytest.raises(KeysFileError, match="no key"):
        ensure_keys_file(path)
