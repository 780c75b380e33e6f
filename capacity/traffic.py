"""The bursty day: when each prompt arrives, on which partition, how long its prompt and answer are.

Shape (every parameter in ``TrafficSettings`` / ``WorkloadSettings``):

- **diurnal curve**: rate(t) = mean x (1 + a cos(2 pi (t - peak) / 24 h)), a = (r - 1) / (r + 1) for a
  peak-to-trough ratio r, so the day's mean is the mean;
- **flash crowds**: ``bursts`` windows at seeded times where the rate is ``burst_multiplier`` x the curve;
- **bursty arrivals**: conversations start as a renewal process with Gamma inter-arrival times
  (shape ``burstiness``; 1 = Poisson) in the time-warped clock of the curve (the cumulative rate),
  the way BurstGPT-Perf models Azure's LLM traces;
- **conversations** of geometric length (mean ``turns_per_conversation``), turns ``think_time_s`` apart
  (exponential), all on one partition (Kafka's key = conversation id);
- **lengths** log-normal with the LMSYS-Chat-1M means (prompt 69.5, answer 214.5 tokens).

The total over the traffic's hours is scaled so the day holds ``messages_per_day`` prompts on average.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from dataclasses import dataclass

from capacity.settings import TrafficSettings, WorkloadSettings

DAY_S = 86_400.0


@dataclass(frozen=True, slots=True)
class Request:
    id: int
    arrival_s: float
    partition: int
    prompt_tokens: int
    output_tokens: int  # the work: tokens the engine generates for it
    conversation: int = 0
    turn: int = 0


def diurnal_amplitude(peak_to_trough: float) -> float:
    return (peak_to_trough - 1.0) / (peak_to_trough + 1.0)


def peak_to_mean(traffic: TrafficSettings) -> float:
    """The diurnal peak over the day's mean rate (flash crowds come on top)."""
    return 1.0 + diurnal_amplitude(traffic.peak_to_trough)


def _lognormal(rng: random.Random, mean: float, sigma: float, lo: int, hi: int) -> int:
    mu = math.log(mean) - sigma * sigma / 2  # so that E[X] = mean
    value = rng.lognormvariate(mu, sigma) if sigma > 0 else mean  # sigma 0: no draw, the mean itself
    return max(lo, min(hi, round(value)))


class RateCurve:
    """rate(t) in conversations/s and its integral, on a grid fine enough for minute-long bursts."""

    def __init__(self, traffic: TrafficSettings, conversations: float, step_s: float = 10.0) -> None:
        rng = random.Random(traffic.seed * 7919 + 1)
        horizon = traffic.hours * 3600.0
        self.bursts = sorted(rng.uniform(0, max(0.0, horizon - traffic.burst_minutes * 60)) for _ in range(traffic.bursts))
        a = diurnal_amplitude(traffic.peak_to_trough)
        peak_s = traffic.peak_hour * 3600.0
        self.step_s = step_s
        n = max(1, math.ceil(horizon / step_s))
        shape = []
        for i in range(n):
            t = (i + 0.5) * step_s
            v = 1.0 + a * math.cos(2 * math.pi * (t - peak_s) / DAY_S)
            if any(b <= t < b + traffic.burst_minutes * 60 for b in self.bursts):
                v *= traffic.burst_multiplier
            shape.append(v)
        # Scale: the day's expected conversations over the traffic's hours (bursts add to the curve's mean
        # only where they fall, so the total is normalised over the whole shape).
        total_shape = sum(shape) * step_s
        scale = conversations * (horizon / DAY_S) / total_shape
        self.rates = [v * scale for v in shape]
        self.cum = [0.0, *itertools.accumulate(r * step_s for r in self.rates)]

    def invert(self, cumulative: float) -> float | None:
        """The time t at which the integral of the rate reaches ``cumulative`` (None past the horizon)."""
        if cumulative >= self.cum[-1]:
            return None
        i = bisect.bisect_right(self.cum, cumulative) - 1
        return i * self.step_s + (cumulative - self.cum[i]) / self.rates[i]


def bursty_day(traffic: TrafficSettings, workload: WorkloadSettings, partitions: int) -> list[Request]:
    """Every prompt of the traffic, in arrival order."""
    rng = random.Random(traffic.seed)
    conversations = traffic.messages_per_day / workload.turns_per_conversation
    curve = RateCurve(traffic, conversations)
    p_end = 1.0 / workload.turns_per_conversation  # geometric turns with that mean
    k = traffic.burstiness
    raw: list[tuple[float, int, int, int, int, int]] = []
    warped = rng.gammavariate(k, 1.0 / k)
    conv = 0
    while (start := curve.invert(warped)) is not None:
        partition = rng.randrange(partitions)
        t, turn = start, 0
        while True:
            raw.append((t, conv, turn, partition,
                        _lognormal(rng, workload.prompt_tokens, workload.length_sigma, 1, 100_000),
                        _lognormal(rng, workload.answer_tokens, workload.length_sigma, 1, workload.max_answer_tokens)))
            if rng.random() < p_end:
                break
            turn += 1
            t += rng.expovariate(1.0 / workload.think_time_s) if workload.think_time_s > 0 else 0.0
        conv += 1
        warped += rng.gammavariate(k, 1.0 / k)
    raw.sort()
    return [Request(i, t, p, pin, pout, c, turn) for i, (t, c, turn, p, pin, pout) in enumerate(raw)]
