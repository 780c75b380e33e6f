"""Faults of the record, against one real worker process (partition intake) and the real broker:
each is answered (dead letter with the reason, an error final chunk where the reply address works,
an error Response), the input is committed, and the worker goes on serving.

Each test names the bug it guards against.
"""

from __future__ import annotations

import time
import uuid

import pytest
from confluent_kafka import Consumer, TopicPartition

from chatpipe.testing.worker import ENGINES, REPLIES, Reader, make_request, send_requests, start_worker
from schemas.records import FinishReason, now_ms

pytestmark = [pytest.mark.integration, pytest.mark.model]

GROUP = "workers"  # start_worker's default: the worker's consumer group is <prefix>workers


@pytest.fixture(scope="module", params=ENGINES)
def service(kafka_stack, tmp_path_factory, request):
    """(KafkaSettings, WorkerProcess) of one worker with its own topic prefix, on each engine."""
    from transport.admin import TopicAdmin
    from transport.settings import KafkaSettings

    kafka = KafkaSettings(bootstrap_servers=kafka_stack.bootstrap_servers, topic_prefix=f"f{uuid.uuid4().hex[:8]}.")
    TopicAdmin(kafka).apply()
    worker = start_worker(kafka, tmp_path_factory.mktemp("faults"), worker_id="faults", CHATPIPE_MAX_BATCH="2",
                          CHATPIPE_WORKER_MAX_IN_FLIGHT="4", engine=request.param)
    worker.wait_serving()
    yield kafka, worker
    code = worker.terminate()
    assert code == 0, f"worker exited {code} on SIGTERM:\n{worker.log()[-3000:]}"


@pytest.fixture
def rd(service):
    r = Reader(service[0])
    yield r
    r.close()


def _letter_of(seen, request_id: str):
    return next((d for d in seen.dead_letters if request_id.encode() in (d.value or b"")), None)


def _wait_committed(kafka, topic: str, timeout_s: float = 30) -> None:
    """Until the worker's group has committed every record of ``topic`` (lag 0)."""
    consumer = Consumer({**kafka.client_config(), "group.id": f"{kafka.topic_prefix}{GROUP}",
                         "enable.auto.commit": False})  # never subscribes: reads the group's offsets only
    try:
        partitions = list(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        deadline = time.monotonic() + timeout_s
        while True:
            committed = {tp.partition: max(0, tp.offset)
                         for tp in consumer.committed([TopicPartition(topic, p) for p in partitions], timeout=10)}
            ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in partitions}
            if committed == ends:
                return
            assert time.monotonic() < deadline, f"not committed: committed {committed}, end offsets {ends}"
            time.sleep(0.5)
    finally:
        consumer.close()


def test_an_unanswerable_reply_address_is_answered_and_the_worker_goes_on(service, rd):
    """Guards against one record stopping all inference: a reply_partition outside the reply topic
    made the chunk send fail (_UNKNOWN_PARTITION), the worker took it for a broker failure and
    exited uncommitted, and every restarted worker died on the same record. A reply topic that does
    not exist failed the same way after 30 s. Sent on one conversation, so the good request waits
    behind the bad ones on the same partition."""
    kafka, worker = service
    replies = kafka.topic(REPLIES)
    outside = make_request(10, conversation="c-bad", reply_to=replies, reply_partition=99)
    missing = make_request(11, conversation="c-bad", reply_to=kafka.topic("chat.nowhere"), reply_partition=0)
    good = make_request(12, conversation="c-bad", max_tokens=4, reply_to=replies, reply_partition=1)
    send_requests(kafka, [outside, missing, good])
    rd.wait_responses([outside.request_id, missing.request_id, good.request_id], 90)
    for bad, reason in ((outside, f"reply_partition 99 is outside '{replies}', which has 6 partition(s)"),
                        (missing, f"reply_to '{kafka.topic('chat.nowhere')}' is not a topic on the broker")):
        response = rd.seen.first_response(bad.request_id)[0]
        assert response.finish_reason is FinishReason.ERROR and reason in response.error, response
        rd.wait_for(lambda s, rid=bad.request_id: _letter_of(s, rid) is not None, 30, "the dead letter")
        letter = _letter_of(rd.seen, bad.request_id)
        assert letter.error_type == "ReplyAddressError" and reason in letter.error_message
    answer, attempt = rd.seen.first_response(good.request_id)
    assert answer.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and answer.tokens_out > 0
    assert worker.proc.poll() is None, f"the worker exited:\n{worker.log()[-3000:]}"
    _wait_committed(kafka, kafka.topic("chat.inference.requests"))


def test_an_expired_request_is_answered_as_expired_not_served(service, rd):
    """Guards against serving stale work: a request whose deadline passed before the worker took it
    (its asker stopped waiting) must cost no generation, and still get an answer: an error final
    chunk (TIMEOUT, "expired"), an error Response and a dead letter, its input committed."""
    kafka, _ = service
    stale = make_request(20, max_tokens=32, reply_to=kafka.topic(REPLIES), reply_partition=2)
    stale.deadline_at = now_ms() - 1_000
    fresh = make_request(21, max_tokens=4, reply_to=kafka.topic(REPLIES), reply_partition=2)
    fresh.deadline_at = now_ms() + 120_000
    send_requests(kafka, [stale, fresh])
    rd.wait_responses([stale.request_id, fresh.request_id], 90)
    response = rd.seen.first_response(stale.request_id)[0]
    assert response.finish_reason is FinishReason.TIMEOUT and response.tokens_out == 0
    assert "RequestExpiredError" in response.error and "deadline passed" in response.error
    rd.wait_for(lambda s: stale.request_id in s.final_chunks and _letter_of(s, stale.request_id), 30,
                "the final chunk and the dead letter")
    chunk = rd.seen.final_chunks[stale.request_id][0]
    assert chunk.finish_reason is FinishReason.TIMEOUT and chunk.error_code == "expired"
    assert _letter_of(rd.seen, stale.request_id).error_type == "RequestExpiredError"
    assert rd.seen.first_response(fresh.request_id)[0].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    _wait_committed(kafka, kafka.topic("chat.inference.requests"))


def test_a_generation_is_stopped_at_its_deadline(service, rd):
    """Guards against a generation running on after its asker stopped waiting (holding a batch slot
    and KV cache for nobody): at the deadline it ends with TIMEOUT, and what was streamed is kept."""
    kafka, _ = service
    req = make_request(30, max_tokens=420, reply_to=kafka.topic(REPLIES), reply_partition=3,
                       text="Write a very long story about a dragon and a knight, with many chapters.")
    req.deadline_at = now_ms() + 5_000
    send_requests(kafka, [req])
    rd.wait_responses([req.request_id], 90)
    response, attempt = rd.seen.first_response(req.request_id)
    print(f"stopped after {response.tokens_out} tokens, {response.completed_at - req.deadline_at} ms after the "
          f"deadline: {response.error}")
    assert response.finish_reason is FinishReason.TIMEOUT, response
    assert 0 < response.tokens_out < 420 and "the deadline passed at token" in response.error
    assert response.completed_at - req.deadline_at < 2_000  # the step running at the deadline completes
    rd.wait_for(lambda s: s.assembler.text(req.request_id, attempt) is not None, 30, "the whole stream")
    assert rd.seen.assembler.text(req.request_id, attempt) == response.text
    chunk = rd.seen.final_chunks[req.request_id][0]
    assert chunk.finish_reason is FinishReason.TIMEOUT and chunk.error_code is None  # a partial answer, not an error
