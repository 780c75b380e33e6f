"""The worker's chunk interval (``chunk_interval_ms``): tokens that come within it after a chunk ride
on the next one, and nothing of the answer is lost on the way.

One worker (our engine: the chunking is the worker's, the same for every engine) with an interval
far longer than the whole generation (1,000 hours: no window boundary falls inside it), so the
stream is exactly: the first chunk, the rest of the text with the ack before the Response, the end
marker.
"""

from __future__ import annotations

import uuid

import pytest

from chatpipe.testing.worker import REPLIES, Reader, make_request, send_requests, start_worker

pytestmark = [pytest.mark.integration, pytest.mark.model]


@pytest.fixture(scope="module")
def interval_worker(kafka_stack, tmp_path_factory):
    from transport.admin import TopicAdmin
    from transport.settings import KafkaSettings

    kafka = KafkaSettings(bootstrap_servers=kafka_stack.bootstrap_servers, topic_prefix=f"ci{uuid.uuid4().hex[:8]}.")
    TopicAdmin(kafka).apply()
    worker = start_worker(kafka, tmp_path_factory.mktemp("chunk-interval"), worker_id="interval",
                          CHATPIPE_WORKER_CHUNK_INTERVAL_MS="3600000000")
    worker.wait_serving()
    yield kafka
    assert worker.terminate() == 0, worker.log()[-3000:]


def test_tokens_within_the_interval_ride_on_the_next_chunk_and_none_is_lost(interval_worker):
    kafka = interval_worker
    req = make_request(1, max_tokens=24, reply_to=kafka.topic(REPLIES), reply_partition=0,
                       text="Count from one to twenty in words.")
    reader = Reader(kafka)
    try:
        send_requests(kafka, [req])
        reader.wait_responses([req.request_id], 120)
        # the end marker follows the Response (read-your-writes, docs/worker.md)
        reader.wait_for(lambda seen: req.request_id in seen.final_chunks, 60, "the end marker")
        response, attempt = reader.seen.first_response(req.request_id)
        chunks = [chunk for chunk, seen_attempt in reader.seen.chunks[req.request_id] if seen_attempt == attempt]
        assert response.tokens_out >= 3, response
        texts = [c for c in chunks if not c.is_final]
        # the first chunk at once, then everything else with the ack before the Response
        assert len(texts) == 2, [(c.index, c.text, c.token_ids) for c in chunks]
        assert chunks[-1].is_final and chunks[-1].text == ""
        assert reader.stream_text(req.request_id, attempt) == response.text
        assert sum(len(c.token_ids) for c in chunks) == response.tokens_out
    finally:
        reader.close()
