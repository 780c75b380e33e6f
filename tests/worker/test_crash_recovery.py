"""50 requests over 2 worker processes, one SIGKILLed mid-generation, in both intake modes.

Guards against: a request lost with its worker (input committed/acknowledged before its answer
was durable), a request answered twice in a way readers cannot dedupe, a stream that does not
match its Response, and a worker that does not shut down cleanly on SIGTERM.
"""

from __future__ import annotations

import time

import pytest

from chatpipe.testing.worker import REPLIES, make_request, send_requests, start_worker
from schemas.records import FinishReason

pytestmark = [pytest.mark.integration, pytest.mark.model]


# vLLM's engine on the partition intake: commit only after the answer is durable, whichever engine answers
@pytest.mark.parametrize("intake,engine", [("partition", "chatpipe"), ("share", "chatpipe"), ("partition", "vllm")])
def test_sigkill_mid_generation_loses_nothing_and_streams_match(intake, engine, worker_kafka, reader, tmp_path):
    kafka = worker_kafka
    a = start_worker(kafka, tmp_path, intake=intake, worker_id="worker-a", engine=engine)
    b = start_worker(kafka, tmp_path, intake=intake, worker_id="worker-b", engine=engine)
    try:
        a.wait_serving()
        b.wait_serving()
        requests = [
            make_request(i, conversation=f"c{i % 20}", max_tokens=8 + i % 5, reply_to=kafka.topic(REPLIES),
                         reply_partition=i % 6, **({"temperature": 0.9, "top_p": 0.95} if i % 3 == 0 else {}))
            for i in range(50)
        ]
        ids = [r.request_id for r in requests]
        send_requests(kafka, requests)

        def a_is_mid_generation(seen):
            return any("worker-a" in seen.chunk_workers.get(rid, ()) and rid not in seen.responses for rid in ids)

        reader.wait_for(a_is_mid_generation, 120, "worker-a streaming a request")
        a.kill()
        killed_at = time.monotonic()
        reader.wait_responses(ids, timeout_s=240)
        print(f"[{intake}] all 50 answered {time.monotonic() - killed_at:.1f}s after the SIGKILL")
        # Chunks and Responses live on different topics: give the reader time to catch up on the
        # chunks of the Responses it keeps (the worker makes a stream's text durable before its
        # Response; the end marker follows the Response, so a killed attempt may lack only that).
        reader.wait_for(lambda s: all(s.assembler.text_without_gaps(rid, s.first_response(rid)[1])
                                      == s.first_response(rid)[0].text for rid in ids),
                        30, "every kept Response's text in its stream")

        duplicates = 0
        rescued = 0
        for req in requests:
            answers = reader.seen.responses[req.request_id]
            duplicates += len(answers) - 1
            response, attempt = answers[0]  # the reader keeps the first Response of a request
            for extra, _ in answers:
                assert extra.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), extra
            assert response.tokens_out > 0 and response.error is None
            assert reader.seen.assembler.text_without_gaps(req.request_id, attempt) == response.text
            if "worker-a" in reader.seen.chunk_workers.get(req.request_id, ()) and response.worker_id == "worker-b":
                rescued += 1
        print(f"[{intake}] duplicates (deduped by request_id): {duplicates}; "
              f"requests worker-a started and worker-b finished: {rescued}")
        assert rescued >= 1, "the SIGKILL interrupted no request: the test proved nothing"
        assert b.terminate() == 0, b.log()[-3000:]
    finally:
        a.kill()
        b.kill()
