"""The engine's measured throughput (inference/engine/throughput.py): what it can do, not what it does now."""

from __future__ import annotations

import pytest

from inference.engine.throughput import MIN_DECODE_STEPS, Throughput


def test_only_saturated_decoding_steps_count_for_the_output_rate_and_an_idle_engine_keeps_its_last():
    t = Throughput(window_s=30.0)
    assert t.rates(0.0) == (0.0, 0.0)  # never measured
    t.record(1.0, 0.1, prompt_tokens=0, generated=2, saturated=False)  # two short requests: 20 tokens/s, not capacity
    assert t.rates(1.0) == (0.0, 0.0)
    t.record(2.0, 0.1, prompt_tokens=40, generated=8, saturated=True)  # prompt work: the prompt rate's
    # each next step ends 0.2 s after the one before: the 0.1 s between steps (the worker sending chunks) is a cost too
    for i in range(1, MIN_DECODE_STEPS + 1):
        t.record(2.0 + 0.2 * i, 0.1, prompt_tokens=0, generated=8, saturated=True)
    decode, prefill = t.rates(2.0 + 0.2 * MIN_DECODE_STEPS)
    assert decode == pytest.approx(8 / 0.2) and prefill == pytest.approx(40 / 0.1)
    assert t.rates(100.0) == (pytest.approx(40.0), pytest.approx(400.0))  # the window is empty: the last stand
    for i in range(MIN_DECODE_STEPS):  # after an idle gap: each step its own time only
        t.record(101.0 + 0.2 * i, 0.2, prompt_tokens=0, generated=4, saturated=True)
    assert t.rates(101.0 + 0.2 * (MIN_DECODE_STEPS - 1))[0] == pytest.approx(20.0)  # not the 99 s gap


def test_a_wave_prompt_step_is_not_output_work_and_one_step_is_not_a_rate():
    """A wave's first step computes a batch of prompts and makes one token per request: an output rate
    over a window that held it was 0.2 tokens/s for a worker that then ran at ~15, and the gateway's
    Retry-After 4,629 s. Its time is prompt work (the prompt rate); the output rate needs enough steps."""
    t = Throughput(window_s=30.0)
    t.record(5.0, 5.0, prompt_tokens=800, generated=8, saturated=True)  # a slow prompt step on a loaded machine
    assert t.rates(5.0) == (0.0, pytest.approx(160.0))  # no output rate yet: refuses nothing
    for i in range(1, MIN_DECODE_STEPS):
        t.record(5.0 + 0.25 * i, 0.25, prompt_tokens=0, generated=8, saturated=True)
        assert t.rates(5.0 + 0.25 * i)[0] == 0.0, i  # too few decoding steps for a rate
    t.record(5.0 + 0.25 * MIN_DECODE_STEPS, 0.25, prompt_tokens=0, generated=8, saturated=True)
    assert t.rates(5.0 + 0.25 * MIN_DECODE_STEPS)[0] == pytest.approx(32.0)  # 8 tokens a 0.25-s step


def test_the_window_stays_bounded_when_nobody_asks_and_threads_can_share_it():
    """record() runs in the engine's thread and prunes as it goes (a CLI run never asks for rates);
    rates() runs in the worker's event loop at the same time."""
    import threading

    t = Throughput(window_s=1.0)
    stop = threading.Event()
    errors: list[BaseException] = []

    def ask() -> None:
        try:
            while not stop.is_set():
                t.rates(199.0)
        except BaseException as exc:  # noqa: BLE001 - reported below, in the test
            errors.append(exc)

    asker = threading.Thread(target=ask)
    asker.start()
    try:
        for i in range(20_000):
            t.record(i * 0.01, 0.01, prompt_tokens=1, generated=1, saturated=True)
    finally:
        stop.set()
        asker.join()
    assert not errors, errors
    assert len(t._decode) <= 102 and len(t._prefill) <= 102
