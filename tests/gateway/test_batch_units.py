"""The Batch API's pure parts: an input file read and checked whole (gateway/batch_lines.py), and how the
batch records several writers publish are merged (transport/batch_book.py ``merge``)."""

from __future__ import annotations

import json
from dataclasses import replace

from gateway.batch_lines import MAX_ERRORS, read_lines
from schemas.records import BatchJob, BatchStatus
from transport.batch_book import merge, status_of

CHAT = "/v1/chat/completions"


def line(custom_id="r1", url=CHAT, method="POST", **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url,
                       "body": body or {"model": "m", "messages": [{"role": "user", "content": "hi"}]}})


def test_good_lines_are_read_with_their_numbers_and_blank_lines_skipped():
    data = "\n".join([line("a"), "", line("b"), ""]).encode()
    lines, errors = read_lines(data, CHAT)
    assert errors == [] and [(x.number, x.custom_id) for x in lines] == [(1, "a"), (3, "b")]
    assert lines[0].body["model"] == "m"


def test_each_bad_line_is_named_with_its_code():
    data = "\n".join([
        line("a"),
        "{not json",
        "[1]",
        line("a"),
        line("c", method="GET"),
        line("d", url="/v1/embeddings"),
        json.dumps({"custom_id": "e", "method": "POST", "url": CHAT, "body": "text"}),
        line("f", model="m", messages=[{"role": "user", "content": "x"}], stream=True),
        line("g", model="m", messages=[{"role": "user", "content": "x"}], temperature="hot"),
        json.dumps({"custom_id": "h", "method": "POST", "url": CHAT, "body": {}, "extra": 1}),
        json.dumps({"custom_id": "", "method": "POST", "url": CHAT, "body": {}}),
    ]).encode()
    lines, errors = read_lines(data, CHAT)
    assert [(e.line, e.code) for e in errors] == [
        (2, "invalid_json_line"), (3, "invalid_json_line"), (4, "duplicate_custom_id"), (5, "invalid_method"),
        (6, "mismatched_url"), (7, "invalid_body"), (8, "invalid_body"), (9, "invalid_body"), (10, "invalid_request"),
        (11, "invalid_custom_id")]
    assert "is on line 1 already" in errors[2].message and errors[7].param == "body.temperature"
    assert errors[0].message.startswith("line 2: not JSON")


def test_an_empty_file_and_too_many_errors_are_said_once():
    assert [e.code for e in read_lines(b"\n\n", CHAT)[1]] == ["empty_file"]
    _, errors = read_lines(b"\n".join(b"x" for _ in range(MAX_ERRORS + 7)), CHAT)
    assert len(errors) == MAX_ERRORS + 1 and errors[-1].code == "too_many_errors" and "7 more" in errors[-1].message


def job(**fields) -> BatchJob:
    return BatchJob(batch_id="batch_1", tenant="acme", key_fingerprint="f", input_file_id="file-1", endpoint=CHAT,
                    created_at=100, **fields)


def test_a_progress_report_written_from_a_copy_older_than_a_cancel_keeps_the_cancel():
    running = merge(None, job(in_progress_at=100, total=10))
    cancel = replace(running, cancelling_at=105)
    stale_progress = replace(running, completed=4, input_tokens=40)  # made before the runner saw the cancel
    seen = merge(merge(running, cancel), stale_progress)
    assert seen.status is BatchStatus.CANCELLING and seen.cancelling_at == 105 and seen.completed == 4
    # and in the other order too: counts never go back, steps never disappear
    other = merge(merge(running, stale_progress), replace(cancel, completed=2))
    assert (other.status, other.completed, other.input_tokens) == (BatchStatus.CANCELLING, 4, 40)


def test_the_status_follows_the_steps_taken():
    assert status_of(job()) is BatchStatus.VALIDATING
    assert status_of(job(in_progress_at=1)) is BatchStatus.IN_PROGRESS
    assert status_of(job(in_progress_at=1, finalizing_at=2)) is BatchStatus.FINALIZING
    assert status_of(job(in_progress_at=1, cancelling_at=2)) is BatchStatus.CANCELLING
    assert status_of(job(in_progress_at=1, cancelling_at=2, cancelled_at=3)) is BatchStatus.CANCELLED
    assert status_of(job(in_progress_at=1, finalizing_at=2, completed_at=3, cancelling_at=2)) is BatchStatus.COMPLETED
    assert status_of(job(in_progress_at=1, expired_at=3)) is BatchStatus.EXPIRED
    assert status_of(job(failed_at=1)) is BatchStatus.FAILED
    ended = merge(job(in_progress_at=1, output_file_id="file-o", completed_at=3), job(in_progress_at=1))
    assert ended.output_file_id == "file-o" and ended.status is BatchStatus.COMPLETED
