"""The worker carries out Deletions on its engine's prefix cache (issue 19, point 3; contract C5).

Through the real broker and a real worker process (SmolLM2): after a user's request was served,
a Deletion on ``chat.deletions`` (key ``tenant/user_id``) makes the worker drop that user's cached
prefix blocks and write a ``DeletionAudit`` (component ``inference.worker:<worker_id>``) to
``chat.deletions.audit``; a Deletion of a user with nothing cached is audited too (0 blocks);
an undecodable record on ``chat.deletions`` is dead-lettered and the worker goes on serving.
Units: a dead deletion thread reaches the worker's failure policy, and a request created before
its user's Deletion but served after it caches nothing.
"""

from __future__ import annotations

import re
import time
import uuid

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from chatpipe.testing.kafka import RecordWriter
from chatpipe.testing.worker import make_request, send_requests, start_worker
from inference.worker.deletions import RecentDeletions, audit_component, prefix_cache_audit
from schemas.codec import default_codec
from schemas.records import Deletion, DeletionScope
from schemas.topics import deletion_key
from transport.settings import KafkaSettings


def read_audits(kafka: KafkaSettings, want: int, timeout_s: float) -> list:
    codec = default_codec()
    consumer = Consumer({**kafka.client_config(), "group.id": f"audit-{uuid.uuid4().hex[:8]}",
                         "enable.auto.commit": False})
    topic = kafka.topic("chat.deletions.audit")
    meta = consumer.list_topics(topic, timeout=10)
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in meta.topics[topic].partitions])
    audits, deadline = [], time.monotonic() + timeout_s
    try:
        while len(audits) < want and time.monotonic() < deadline:
            for msg in consumer.consume(10, 0.5):
                if msg.error() is None:
                    audits.append((msg.key(), codec.decode(msg.value())))
    finally:
        consumer.close()
    return audits


def dropped_blocks(log: str, event_id: str) -> int | None:
    m = re.search(rf"deletion {event_id}: (\d+) prefix-cache block\(s\)", log)
    return int(m.group(1)) if m else None


@pytest.mark.integration
@pytest.mark.model
def test_a_deletion_drops_the_users_prefix_blocks_and_is_audited(worker_kafka, reader, tmp_path):
    worker = start_worker(worker_kafka, tmp_path)
    producer = RecordWriter(worker_kafka)
    try:
        worker.wait_serving()
        req = make_request(1, text="Tell me about Kafka partitions and consumer groups in two sentences.")
        send_requests(worker_kafka, [req])
        reader.wait_responses([req.request_id], 120)
        assert reader.seen.first_response(req.request_id)[0].error is None

        topic = worker_kafka.topic("chat.deletions")
        producer.send_bytes(topic, b"not a deletion", key=b"t1/u1")  # dead-lettered, nothing stops
        erased = Deletion(scope=DeletionScope.USER, user_id=req.user_id, tenant=req.tenant)
        nobody = Deletion(scope=DeletionScope.CONVERSATION, user_id="nobody", tenant=req.tenant,
                          conversation_id="c9")
        for deletion in (erased, nobody):
            producer.send(topic, deletion, key=deletion_key(deletion.tenant, deletion.user_id))
        producer.flush()

        audits = read_audits(worker_kafka, 2, 60)
        by_event = {a.deletion_event_id: (key, a) for key, a in audits}
        assert set(by_event) == {erased.event_id, nobody.event_id}
        key, audit = by_event[erased.event_id]
        assert audit.component == f"inference.worker:{worker.worker_id}"
        assert (audit.tenant, audit.user_id, audit.scope, audit.requested_at) == (
            req.tenant, req.user_id, DeletionScope.USER, erased.created_at)
        assert key == req.user_id.encode()  # the audit topic's key, as streams' audits
        assert by_event[nobody.event_id][1].conversation_id == "c9"

        # The prompt (default system block + the user turn) filled full blocks: those were dropped.
        assert dropped_blocks(worker.log(), erased.event_id) >= 2
        assert dropped_blocks(worker.log(), nobody.event_id) == 0

        reader.wait_for(lambda s: any(d.source_topic == topic for d in s.dead_letters), 30,
                        "the dead letter of the undecodable deletion")
        again = make_request(2, text="Tell me about Kafka partitions and consumer groups in two sentences.")
        send_requests(worker_kafka, [again])  # still serving
        reader.wait_responses([again.request_id], 120)
        assert worker.proc.poll() is None
    finally:
        producer.close()
        assert worker.terminate() == 0


def test_a_request_created_before_its_users_deletion_is_covered():
    recent = RecentDeletions(capacity=2)
    deletion = Deletion(scope=DeletionScope.USER, user_id="ada", tenant="acme", created_at=1_000)
    recent.add(deletion)
    assert recent.covers("acme", "ada", 999) and recent.covers("acme", "ada", 1_000)
    assert not recent.covers("acme", "ada", 1_001)  # she came back after the deletion
    assert not recent.covers("globex", "ada", 999) and not recent.covers("acme", "bob", 999)
    for user in ("u1", "u2"):
        recent.add(Deletion(scope=DeletionScope.USER, user_id=user, tenant="acme", created_at=5))
    assert not recent.covers("acme", "ada", 999)  # bounded: the oldest is forgotten first
    audit = prefix_cache_audit(deletion, "w1")
    assert audit.component == audit_component("w1") == "inference.worker:w1"
    assert audit.deletion_event_id == deletion.event_id and audit.memory_points_deleted == 0
