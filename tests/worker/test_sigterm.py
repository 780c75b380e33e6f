"""SIGTERM with work in flight: the worker stops taking work, hands back what it cannot finish
within its grace period (no commit / RELEASE), exits 0, and another worker answers it.

Guards against a shutdown that loses in-flight requests (committing or accepting them unanswered)
or hangs.
"""

from __future__ import annotations

import time

import pytest

from chatpipe.testing.worker import REPLIES, make_request, send_requests, start_worker
from schemas.records import FinishReason

pytestmark = [pytest.mark.integration, pytest.mark.model]


@pytest.mark.parametrize("intake", ["partition", "share"])
def test_sigterm_hands_back_unfinished_requests(intake, worker_kafka, reader, tmp_path):
    kafka = worker_kafka
    first = start_worker(kafka, tmp_path, intake=intake, worker_id="first", CHATPIPE_WORKER_GRACE_S="0")
    try:
        first.wait_serving()
        # 64 tokens: long enough to be cut by the SIGTERM, short enough that the second worker finishes it
        # within the share record lock (60 s less its margin) on a loaded 2-core machine, where one CI run's
        # second worker made under 96 tokens in those 55 s (finish TIMEOUT).
        req = make_request(1, max_tokens=64, reply_to=kafka.topic(REPLIES), reply_partition=0,
                           text="Write a long story about a lighthouse keeper.")
        send_requests(kafka, [req])
        reader.wait_for(lambda s: s.chunk_count.get(req.request_id, 0) >= 2, 60, "the generation to start")
        started = time.monotonic()
        assert first.terminate(timeout_s=60) == 0, first.log()[-3000:]
        print(f"[{intake}] SIGTERM to exit: {time.monotonic() - started:.1f}s")
        reader.poll(1.0)
        assert req.request_id not in reader.seen.responses, "a handed-back request must not be answered"
        second = start_worker(kafka, tmp_path, intake=intake, worker_id="second")
        try:
            second.wait_serving()  # its start is not part of the answer's time: 90 s on one loaded CI machine
            reader.wait_responses([req.request_id], 120)
            response, attempt = reader.seen.first_response(req.request_id)
            assert response.worker_id == "second" and response.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
            assert reader.stream_text(req.request_id, attempt) == response.text
        finally:
            assert second.terminate() == 0
    finally:
        first.kill()
