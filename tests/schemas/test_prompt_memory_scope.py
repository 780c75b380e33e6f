"""PromptRequest v4's ``memory_scope``: written and read back, and every older version read as
USER (the producer vouched for ``user_id`` before scopes existed, so its memory is the user's)."""

from __future__ import annotations

import pytest

from schemas.codec import default_codec, to_avro_dict
from schemas.records import ChatMessage, MemoryScope, PromptRequest
from schemas.registry import default_registry

codec = default_codec()


def prompt(**kw) -> PromptRequest:
    return PromptRequest(conversation_id="c1", user_id="ada", tenant="acme", model="m",
                         messages=[ChatMessage("user", "hi")], **kw)


def test_the_scope_round_trips_and_defaults_to_user():
    assert prompt().memory_scope is MemoryScope.USER and prompt().schema_version >= 4
    decoded = codec.decode(codec.encode(prompt(memory_scope=MemoryScope.CONVERSATION)))
    assert decoded.memory_scope is MemoryScope.CONVERSATION


@pytest.mark.parametrize("old_version", [1, 2, 3])
def test_prompts_of_older_versions_read_as_user_scope(old_version):
    # only the fields that version had (memory_scope came in v4, deadline_at in v3, priority in v2)
    schema_fields = {f["name"] for f in default_registry().version("PromptRequest", old_version).parsed["fields"]}
    old = {k: v for k, v in to_avro_dict(prompt(memory_scope=MemoryScope.CONVERSATION)).items() if k in schema_fields}
    old["schema_version"] = old_version
    decoded = codec.decode(codec.encode_dict("PromptRequest", old, version=old_version))
    assert decoded.memory_scope is MemoryScope.USER and decoded.user_id == "ada"
