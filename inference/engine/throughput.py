"""What the engine can do, measured: tokens per second while it had more work than its batch.

The gateway estimates a new request's wait from the output work queued ahead of it at the output rate,
and its own prefill at the prompt rate (``transport/fleet.py``), so the rates must be the engine's
capacity, not its current output: an engine with two short requests running makes few tokens per second
and could make many more. Only steps taken while requests were waiting (or every batch slot
was taken) and that computed no prompt tokens count for the output rate, each with the wall time since
the step before it (the worker's own work between steps, sending chunks and taking records, is part of
what a token costs). The prompt rate is over every step that computed prompt tokens: the cost of one
more request's prefill.

Why steps with prompt tokens are left out of the output rate: a wave's first step computes the prompts
of a whole batch and makes one token per request, and the output rate over a window that held it said a
fraction of the real one, on a loaded machine a small fraction: a fresh worker reported 0.2 tokens/s for a
batch that then ran at ~15, and the gateway answered 429 with a Retry-After of 4,629 s
(tests/gateway/test_admission.py in a CI run with three test stacks beside it; after a restart the fault
suite's worker refused prompts the same way). And the output rate is taken only from a window of
``MIN_DECODE_STEPS`` such steps or more: one step alone is noise on a loaded machine.

A window of ``window_s``; when too few steps of a kind fell in it (the engine idle or unsaturated), the
last rate measured stands: an idle engine still knows what it did when busy. 0.0 = never measured, and
refuses nothing (``transport/fleet.py``).
"""

from __future__ import annotations

import collections
import threading

MAX_GAP_S = 1.0  # the longest time between two saturated steps that counts as the work's cost
MIN_DECODE_STEPS = 8  # saturated decoding steps in the window before an output rate is taken from it (above)


class Throughput:
    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        # (end, seconds, tokens) of the steps that count, per rate
        self._decode: collections.deque[tuple[float, float, int]] = collections.deque()
        self._prefill: collections.deque[tuple[float, float, int]] = collections.deque()
        self._last = {"decode": 0.0, "prefill": 0.0}
        self._last_saturated_end: float | None = None
        # record() runs in the engine's thread, rates() in the worker's event loop (its heartbeat): a deque
        # iterated in one while the other appends raises "mutated during iteration".
        self._lock = threading.Lock()

    def record(self, end: float, seconds: float, prompt_tokens: int, generated: int, saturated: bool) -> None:
        """One step that ended at ``end`` and took ``seconds``. A saturated step right after another one
        counts the whole time since that one ended: what the worker does between steps (sending the
        chunks, taking records) is part of what a token costs it."""
        with self._lock:
            self._record(end, seconds, prompt_tokens, generated, saturated)

    def _record(self, end: float, seconds: float, prompt_tokens: int, generated: int, saturated: bool) -> None:
        if saturated and generated and not prompt_tokens:  # prompt work is the prompt rate's (above)
            since_last = end - self._last_saturated_end if self._last_saturated_end is not None else seconds
            # a longer gap is the engine idling (its waiting requests were cancelled), not its cost
            self._decode.append((end, since_last if seconds < since_last <= seconds + MAX_GAP_S else seconds,
                                 generated))
        self._last_saturated_end = end if saturated else None
        if prompt_tokens:
            self._prefill.append((end, seconds, prompt_tokens))
        for steps in (self._decode, self._prefill):  # bounded even when nobody asks for the rates
            while len(steps) > 1 and end - steps[0][0] > self.window_s:
                steps.popleft()

    def rates(self, now: float) -> tuple[float, float]:
        """(output tokens/s while saturated, prompt tokens/s)."""
        with self._lock:
            return (self._rate("decode", self._decode, now, MIN_DECODE_STEPS),
                    self._rate("prefill", self._prefill, now, 1))

    def _rate(self, kind: str, steps: collections.deque[tuple[float, float, int]], now: float,
              min_steps: int) -> float:
        """The rate over ``steps`` in the window, once it holds ``min_steps`` of them; else the last one."""
        while steps and now - steps[0][0] > self.window_s:
            steps.popleft()
        if len(steps) < min_steps:
            return self._last[kind]
        seconds = sum(s for _, s, _ in steps)
        if seconds > 0:
            self._last[kind] = sum(n for _, _, n in steps) / seconds
        return self._last[kind]


class StepCounts:
    """An engine's step counts for its ``EngineStats``, whichever engine steps (ours, or vLLM's behind
    ``inference.vllm_engine``): steps, prompt tokens computed and tokens generated since start, the
    generated rate over the last ``recent_s`` seconds (the current output), and the saturated rates
    (``Throughput``: the capacity). Called by the step thread (``record``) and by anyone (``stats``)."""

    def __init__(self, recent_s: float = 5.0) -> None:
        self.recent_s = recent_s
        self.steps = 0
        self.prompt_tokens = 0
        self.generated = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens) per step
        self.throughput = Throughput()

    def record(self, now: float, seconds: float, prompt_tokens: int, generated: int, saturated: bool) -> None:
        """One step that ended at ``now`` after ``seconds``."""
        self.steps += 1
        self.prompt_tokens += prompt_tokens
        self.generated += generated
        self._recent.append((now, generated))
        self.throughput.record(now, seconds, prompt_tokens, generated, saturated)

    def tokens_per_s(self, now: float) -> float:
        """Tokens generated per second over the steps of the last ``recent_s`` seconds (0.0 under two steps)."""
        while self._recent and now - self._recent[0][0] > self.recent_s:
            self._recent.popleft()
        recent = list(self._recent)
        span = now - recent[0][0] if len(recent) > 1 else 0.0
        return sum(n for _, n in recent[1:]) / span if span > 0 else 0.0
