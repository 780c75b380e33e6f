"""share intake: a generation never outlives its record's acquisition lock.

Guards against a generation longer than the lock (``share.record.lock.duration.ms``; the client
cannot renew it) being redelivered while it still runs: the broker hands the record to another
member, the request is served twice, and the first worker's ACCEPT comes too late. With the
shortest lock the broker allows (15 s) the worker must stop the generation at lock - its margin, answer
it (TIMEOUT, the text so far) and ACCEPT it: one Response, no second delivery. The margin here is 8 s, not
the default 5: in a whole-suite run on 2 cores, a JVM starting beside it once held the worker to 2.5
tokens a second, and the Response and ACCEPT of a generation stopped 5 s before the lock came 0.3 s late.
"""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from chatpipe.testing.ports import free_port
from chatpipe.testing.worker import REPLIES, make_request, send_requests, start_worker
from schemas.records import FinishReason

pytestmark = [pytest.mark.integration, pytest.mark.model]


def test_a_long_generation_is_stopped_before_its_record_lock_runs_out(worker_kafka, reader, tmp_path):
    kafka = worker_kafka
    port = free_port()
    worker = start_worker(kafka, tmp_path, intake="share", worker_id="locked",
                          CHATPIPE_WORKER_SHARE_RECORD_LOCK_MS="15000", CHATPIPE_WORKER_SHARE_LOCK_MARGIN_MS="8000",
                          CHATPIPE_WORKER_METRICS_PORT=str(port),
                          CHATPIPE_WORKER_LAG_INTERVAL_S="1")
    try:
        worker.wait_serving()
        req = make_request(1, max_tokens=420, reply_to=kafka.topic(REPLIES), reply_partition=5,
                           text="Write a very long story about a lighthouse keeper, with many chapters.")
        send_requests(kafka, [req])
        started = time.monotonic()
        # The share group's lag (transport/share_offsets.py asks the broker): the record is acquired, not
        # acknowledged, while it is generated: 1 record waiting, its age growing.
        key = (f"{kafka.topic_prefix}workers.share", kafka.topic("chat.inference.requests"))
        while (lag := _share_lag(port, key))[0] != 1 and time.monotonic() - started < 8:
            time.sleep(0.5)
        assert lag[0] == 1 and lag[1] > 0, lag
        reader.wait_responses([req.request_id], 120)
        took = time.monotonic() - started
        response, attempt = reader.seen.first_response(req.request_id)
        print(f"answered after {took:.1f} s with {response.tokens_out} tokens: {response.error}")
        assert response.finish_reason is FinishReason.TIMEOUT and "share record lock (15 s)" in response.error
        assert 0 < response.tokens_out < 420
        reader.wait_for(lambda s: s.assembler.text(req.request_id, attempt) is not None, 30, "the whole stream")
        assert reader.seen.assembler.text(req.request_id, attempt) == response.text
        time.sleep(15)  # past the lock: a redelivery would show as a second serving attempt
        reader.poll(1.0)
        assert len(reader.seen.responses[req.request_id]) == 1, "the record was delivered again"
        assert _share_lag(port, key) == (0, 0), "the ACCEPTed record still counted as waiting"
        assert worker.terminate() == 0, worker.log()[-3000:]
    finally:
        worker.kill()


def _share_lag(port: int, key: tuple[str, str]) -> tuple[float | None, float | None]:
    """(records, seconds) of the worker's ``chatpipe_consumer_lag_*`` for (group, topic) ``key``."""
    body = urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
        f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if (sample.labels.get("group"), sample.labels.get("topic")) == key:
                found[sample.name] = sample.value
    return found.get("chatpipe_consumer_lag_records"), found.get("chatpipe_consumer_lag_seconds")
