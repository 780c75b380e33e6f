"""Admission by estimated wait (transport/fleet.py, gateway/admission.py), in this process: worker reports in,
a decision out. The running pipeline's answers to the same questions are test_admission.py's."""

from __future__ import annotations

import math
import time

import pytest

from gateway.admission import Admission, work_of
from transport.fleet import RETRY_MARGIN, Fleet, Work
from gateway.metrics import GatewayMetrics
from gateway.openai_api import OpenAIError
from gateway.settings import GatewaySettings
from schemas.records import ChatMessage, PromptRequest, SamplingParams, WorkerState, WorkerStatus, now_ms

MODEL = "smollm2-135m-instruct"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def status(worker="w1", *, running=0, waiting=0, max_running=8, queued_output=0, running_output=0, decode=0.0,
           prefill=0.0, state=WorkerState.SERVING, model=MODEL) -> WorkerStatus:
    return WorkerStatus(worker_id=worker, model=model, state=state, running=running, waiting=waiting,
                        kv_cache_used_tokens=0, kv_cache_total_tokens=1, tokens_per_s=decode, max_running=max_running,
                        queued_output_tokens=queued_output, running_output_tokens=running_output,
                        decode_tokens_per_s=decode, prefill_tokens_per_s=prefill)


def warm_fleet(*statuses: WorkerStatus, stale_s: float = 10.0) -> tuple[Fleet, Clock]:
    clock = Clock()
    fleet = Fleet(stale_s, clock=clock)
    clock.now += stale_s  # past the first report period
    for s in statuses:
        fleet.update(s)
    return fleet, clock


def prompt(max_tokens=32, timeout_s=300.0, text="hello there", n=1) -> PromptRequest:
    return PromptRequest(conversation_id="c", user_id="u", tenant="acme", model=MODEL,
                         messages=[ChatMessage(role="user", content=text)],
                         sampling=SamplingParams(max_tokens=max_tokens, n=n), deadline_at=now_ms() + int(timeout_s * 1000))


def test_a_free_batch_slot_means_no_wait_only_the_prompts_own_prefill():
    fleet, _ = warm_fleet(status(running=3, waiting=2, max_running=8, decode=50.0, prefill=400.0))
    estimate = fleet.estimate(MODEL, Work(), prompt_tokens=200)
    assert estimate.wait_s == 0 and estimate.first_token_s == pytest.approx(0.5) and estimate.measured


def test_a_full_batch_waits_for_the_work_ahead_queued_and_running_at_the_measured_rate():
    # 8 running with 400 output tokens left between them, 4 waiting with 600 tokens of budget, 50 tokens/s
    # when saturated: (600 + 400) / 50 = 20 s (a batch in step frees no slot before it is done)
    fleet, _ = warm_fleet(status(running=8, waiting=4, max_running=8, queued_output=600, running_output=400,
                                 decode=50.0))
    estimate = fleet.estimate(MODEL, Work(), prompt_tokens=0)
    assert estimate.wait_s == pytest.approx(20.0) and estimate.first_token_s == pytest.approx(20.0)


def test_the_gateways_own_unreported_work_counts_when_the_reports_show_less():
    """Reports lag by up to a heartbeat, and records in Kafka or streams are in no report: 256 requests sent
    at once must not all be admitted against a report that shows an empty queue."""
    fleet, _ = warm_fleet(status(running=8, waiting=0, max_running=8, running_output=80, decode=40.0))
    alone = fleet.estimate(MODEL, Work(), prompt_tokens=0)
    behind_own = fleet.estimate(MODEL, Work(requests=100, output_tokens=3200), prompt_tokens=0)
    assert alone.wait_s == pytest.approx(80 / 40)
    assert behind_own.wait_s == pytest.approx((3200 + 80) / 40)
    # with free slots, the gateway's own not-started requests fill them first
    fleet, _ = warm_fleet(status(running=2, max_running=8, decode=40.0))
    assert fleet.estimate(MODEL, Work(requests=5), prompt_tokens=0).wait_s == 0
    assert fleet.estimate(MODEL, Work(requests=6, output_tokens=600), prompt_tokens=0).wait_s > 0


def test_several_workers_are_one_pool():
    one = status("w1", running=8, max_running=8, queued_output=400, running_output=400, decode=50.0)
    two = status("w2", running=8, max_running=8, queued_output=400, running_output=400, decode=50.0)
    fleet, _ = warm_fleet(one, two)
    assert fleet.estimate(MODEL, Work(), 0).wait_s == pytest.approx((800 + 800) / 100)
    assert fleet.estimate(MODEL, Work(), 0).workers == 2


def test_stale_failed_and_other_models_reports_do_not_count():
    fleet, clock = warm_fleet(status("w1", decode=10.0), status("w2", state=WorkerState.FAILED),
                              status("w3", model="other"))
    assert [s.worker_id for s in fleet.serving(MODEL)] == ["w1"]
    clock.now += 10.5
    assert fleet.serving(MODEL) == [] and fleet.estimate(MODEL, Work(), 0) is None
    fleet.update(status("w1", state=WorkerState.DRAINING))
    assert fleet.estimate(MODEL, Work(), 0) is None


def test_long_silent_workers_are_forgotten_once_there_are_many():
    fleet, clock = warm_fleet(*(status(f"old-{i}") for i in range(64)))
    clock.now += 1000  # restarted long ago under other ids (host-pid)
    fleet.update(status("new", decode=10.0))
    assert list(fleet._latest) == ["new"] and [s.worker_id for s in fleet.serving(MODEL)] == ["new"]


def test_unknowns_do_not_refuse():
    # saturated before any rate was measured; a v2 report without a batch size
    for report in (status(running=8, waiting=9, max_running=8, queued_output=10_000),
                   status(running=8, waiting=9, max_running=0, queued_output=10_000, decode=1.0)):
        fleet, _ = warm_fleet(report)
        estimate = fleet.estimate(MODEL, Work(), 0)
        assert estimate.wait_s == 0 and not estimate.measured


def admission(fleet: Fleet, **settings) -> Admission:
    return Admission(GatewaySettings(**settings), GatewayMetrics(), fleet)


def test_a_request_that_cannot_get_its_first_token_in_time_gets_429_with_the_excess_as_retry_after():
    fleet, _ = warm_fleet(status(running=8, waiting=10, max_running=8, queued_output=650, running_output=400,
                                 decode=50.0))  # (650 + 400) / 50 = 21 s
    gate = admission(fleet)
    gate.check(prompt(timeout_s=30), 0, 0, Work())  # 21 s < 30 s: taken
    started = time.perf_counter()
    with pytest.raises(OpenAIError) as refused:
        gate.check(prompt(timeout_s=15.3), 0, 0, Work())
    assert time.perf_counter() - started < 0.1
    error = refused.value
    assert error.status == 429 and error.code == "deadline_unreachable" and error.type == "rate_limit_error"
    # 17 s: the queue drains the excess (5.7 s) meanwhile, and the margin for a rate that moves (0.5 x 21 s); not a
    # whole number (16.2), as the time left is a hair under 15.3 s by the time the gateway looks
    assert int(error.headers["Retry-After"]) == math.ceil(21 - 15.3 + RETRY_MARGIN * 21) == 17
    assert "21 s" in error.message and "retry after 17 s" in error.message


def test_no_worker_serving_the_model_is_503_at_once_but_not_before_reports_could_have_come():
    clock = Clock()
    fleet = Fleet(10.0, clock=clock)
    gate = admission(fleet)
    gate.check(prompt(), 0, 0, Work())  # just started: nothing known, nothing refused
    clock.now += 10.0
    with pytest.raises(OpenAIError) as refused:
        gate.check(prompt(), 0, 0, Work())
    assert refused.value.status == 503 and refused.value.code == "no_worker"
    assert MODEL in refused.value.message and refused.value.headers["Retry-After"] == "10"


def test_the_memory_guard_still_bounds_what_the_gateway_holds():
    fleet, _ = warm_fleet(status(decode=10.0))
    gate = admission(fleet, max_pending=4, tenant_share=0.5)
    with pytest.raises(OpenAIError) as refused:
        gate.check(prompt(), 4, 0, Work())
    assert refused.value.code == "backlog_full"
    with pytest.raises(OpenAIError) as refused:
        gate.check(prompt(), 2, 2, Work())
    assert refused.value.code == "tenant_backlog_full"
    assert GatewaySettings().max_pending >= 1000  # the estimate decides by default, not this count


def test_a_prompts_work_is_its_characters_and_every_choices_budget():
    work = work_of(prompt(max_tokens=50, text="x" * 400, n=3))
    assert (work.requests, work.prompt_tokens, work.output_tokens) == (1, 100, 150)


def test_the_clients_timeout_header_is_its_deadline_within_the_gateways():
    from gateway.translate import TIMEOUT_HEADER, client_timeout_s, deadline_at

    assert client_timeout_s(None) is None and client_timeout_s("2.5") == 2.5
    for bad in ("0", "-1", "soon", "nan", "inf"):
        with pytest.raises(OpenAIError) as refused:
            client_timeout_s(bad)
        assert refused.value.status == 400 and refused.value.param == TIMEOUT_HEADER, bad
    settings = GatewaySettings(first_chunk_timeout_s=300)
    assert deadline_at(1_000, settings, 5) == 6_000
    assert deadline_at(1_000, settings, 900) == deadline_at(1_000, settings) == 301_000  # never past the gateway's
