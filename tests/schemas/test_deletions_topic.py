"""``chat.deletions`` is the log of erasures, kept forever and never compacted (issue 19, contract C3):
`chatpipe topics apply` must move a deployment whose topic was created compacted (keyed by user id
alone, so one tenant's deletion could compact away another's) to the new config, on the real broker."""

from __future__ import annotations

import time
import uuid

import pytest

pytestmark = pytest.mark.integration


def test_apply_moves_a_compacted_deletions_topic_to_delete_and_keep_forever(kafka_stack):
    from schemas.topics import deletion_key, spec
    from transport.admin import TopicAdmin
    from transport.settings import KafkaSettings

    kafka = KafkaSettings(bootstrap_servers=kafka_stack.bootstrap_servers, topic_prefix=f"d{uuid.uuid4().hex[:8]}.")
    admin = TopicAdmin(kafka)
    name = kafka.topic("chat.deletions")
    admin.create_topic(name, 3, {"cleanup.policy": "compact", "retention.ms": "-1"})  # as the old catalog made it
    changes = [c for c in admin.apply() if c.topic == name]
    assert [c.action for c in changes] == ["set-config"], changes
    deadline = time.monotonic() + 15  # the broker applies a config change a moment after it answers
    while True:
        config = admin._configs([name])[name]
        if config["cleanup.policy"] == "delete" or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert (config["cleanup.policy"], config["retention.ms"]) == ("delete", "-1")
    assert not [c for c in admin.plan() if c.topic == name], "a second apply changes nothing"
    assert spec("chat.deletions").key == "tenant/user_id" and deletion_key("acme", "ada") == b"acme/ada"
