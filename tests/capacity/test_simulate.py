"""The simulation: conservation, bounds, closed-form cases, and the direction of every knob."""

from __future__ import annotations

import math

import pytest

from capacity.settings import ScalingSettings, TrafficSettings, WorkloadSettings
from capacity.simulate import Curve, Simulation, WorkerParams, percentile, simulate, sticky_assignment
from capacity.traffic import Request, bursty_day

CURVE = Curve(((1, 10.0), (2, 18.0), (4, 40.0)))


def backlog(n: int, tokens: int = 100, partitions: int = 6) -> list[Request]:
    return [Request(i, 0.0, i % partitions, 70, tokens) for i in range(n)]


def small_day(messages: int = 3000, hours: float = 2.0, seed: int = 3) -> list[Request]:
    traffic = TrafficSettings(messages_per_day=int(messages * 24 / hours), hours=hours, seed=seed, bursts=1,
                              burst_minutes=10, peak_hour=1.0)
    return bursty_day(traffic, WorkloadSettings(answer_tokens=100, think_time_s=20), 6)


def test_the_curve_interpolates_and_saturates():
    assert CURVE.rate(0) == 0
    assert CURVE.rate(1) == 10
    assert CURVE.rate(3) == pytest.approx(29.0)
    assert CURVE.rate(9) == 40  # past the batch: the rest wait
    assert CURVE.max_batch == 4
    with pytest.raises(ValueError):
        Curve(((0, 5.0),))


def test_a_backlog_drains_in_the_closed_form_time():
    # 64 requests x 100 tokens, one worker running 4 at 40 tokens/s: 6,400 / 40 = 160 s, the last start at 150 s.
    result = simulate(backlog(64), WorkerParams(CURVE), replicas=1)
    assert result.drain_s() == pytest.approx(160.0)
    assert max(result.queue_waits()) == pytest.approx(150.0)
    assert result.pod_seconds >= 160.0


def test_two_workers_split_the_partitions_and_the_tail_runs_slower():
    # 6 partitions, 3 per worker: 33 and 31 requests. 33 = 8 full batches (80 s) + 1 alone at 10 tokens/s (10 s).
    result = simulate(backlog(64), WorkerParams(CURVE), replicas=2)
    assert result.drain_s() == pytest.approx(90.0)


def test_every_request_is_served_once_for_the_client_and_in_order_of_its_life():
    requests = small_day()
    scaling = ScalingSettings(max_replicas=8, lag_threshold=4)
    result = simulate(requests, WorkerParams(CURVE, pod_start_s=30, join_s=2), scaling=scaling)
    assert len(result.done) == len(requests)
    for r, start, done in zip(result.requests, result.start, result.done):
        assert not math.isnan(done)
        assert r.arrival_s - 1e-9 <= start <= done
        assert done - start >= r.output_tokens / CURVE.rate(CURVE.max_batch) * CURVE.max_batch / 4 - 1e-6


def test_replicas_stay_within_min_and_max_and_the_partitions():
    requests = small_day(messages=6000)
    for max_replicas in (2, 4, 20):
        scaling = ScalingSettings(min_replicas=1, max_replicas=max_replicas, lag_threshold=2)
        result = simulate(requests, WorkerParams(CURVE, pod_start_s=10), scaling=scaling)
        pods = [s.pods for s in result.samples]
        assert min(pods) >= 1
        assert max(pods) <= min(max_replicas, 6)  # allowIdleConsumers false: never more than the 6 partitions
    assert max(pods) == 6


def test_allow_idle_consumers_lifts_the_partition_cap_and_share_intake_uses_them():
    requests = small_day(messages=6000)
    lifted = ScalingSettings(max_replicas=20, lag_threshold=2, allow_idle_consumers=True)
    partition = simulate(requests, WorkerParams(CURVE, pod_start_s=10), scaling=lifted)
    share = simulate(requests, WorkerParams(CURVE, pod_start_s=10, intake="share"), scaling=lifted)
    assert partition.max_pods > 6  # created, but the extra ones own no partition
    assert share.max_pods > 6
    assert percentile(share.queue_waits(), 0.99) < percentile(partition.queue_waits(), 0.99)


def test_more_workers_wait_less():
    requests = small_day(messages=5000)
    waits = []
    for n in (1, 2, 3, 6):
        waits.append(percentile(simulate(requests, WorkerParams(CURVE), replicas=n).queue_waits(), 0.99))
    assert waits == sorted(waits, reverse=True)
    assert waits[0] > waits[-1]
    keda = []
    for max_replicas in (1, 2, 6):
        scaling = ScalingSettings(max_replicas=max_replicas, lag_threshold=4)
        keda.append(percentile(simulate(requests, WorkerParams(CURVE, pod_start_s=10), scaling=scaling).queue_waits(), 0.5))
    assert keda == sorted(keda, reverse=True)


def test_scaling_up_then_down_follows_the_load_and_costs_fewer_gpu_hours_than_the_max():
    requests = small_day(messages=5000)
    scaling = ScalingSettings(max_replicas=6, lag_threshold=4, scale_down_stabilization_s=120)
    result = simulate(requests, WorkerParams(CURVE, pod_start_s=20, join_s=2), scaling=scaling)
    assert result.max_pods > result.min_pods
    assert result.gpu_hours() < result.max_pods * result.end_s / 3600
    assert result.samples[-1].pods <= result.max_pods


def test_scale_to_zero_and_back():
    requests = [Request(0, 0.0, 0, 10, 50), Request(1, 2000.0, 1, 10, 50)]
    scaling = ScalingSettings(min_replicas=0, cooldown_period_s=300)
    result = simulate(requests, WorkerParams(CURVE, pod_start_s=10), scaling=scaling)
    assert [s.pods for s in result.samples][0] == 0
    assert result.min_pods == 0
    # Each request waits for KEDA's next poll (<= 30 s) and a pod start (10 s).
    assert all(10.0 <= w <= 40.0 + 1e-6 for w in result.queue_waits())


def test_a_rebalance_restarts_moved_work_and_serves_finished_records_again():
    # One worker busy on every partition; a second joins at t = 5 s and takes 3 partitions: their running
    # requests are cancelled and re-read from the committed offset.
    requests = backlog(24, tokens=200)
    scaling = ScalingSettings(min_replicas=1, max_replicas=2, lag_threshold=1, hpa_sync_period_s=5)
    result = simulate(requests, WorkerParams(CURVE, pod_start_s=0, join_s=1), scaling=scaling)
    assert result.max_pods == 2
    assert result.restarts > 0
    assert all(not math.isnan(d) for d in result.done)


def test_sticky_assignment_is_balanced_and_moves_little():
    a = sticky_assignment(6, [0], {})
    assert set(a.values()) == {0}
    b = sticky_assignment(6, [0, 1], a)
    assert sorted(list(b.values()).count(m) for m in (0, 1)) == [3, 3]
    assert sum(1 for p in range(6) if a[p] != b[p]) == 3
    c = sticky_assignment(6, [0, 1, 2, 3], b)
    assert sorted(list(c.values()).count(m) for m in range(4)) == [1, 1, 2, 2]
    assert sticky_assignment(6, [0, 1, 2, 3, 4, 5, 6, 7], c).values().__len__() == 6
    d = sticky_assignment(6, [1], c)  # members leave: the survivor takes everything
    assert set(d.values()) == {1}
    assert sticky_assignment(6, [], d) == {p: None for p in range(6)}


def test_the_bursty_day_has_the_requested_volume_and_shape():
    traffic = TrafficSettings(messages_per_day=50_000, seed=11)
    day = bursty_day(traffic, WorkloadSettings(), 6)
    assert abs(len(day) - 50_000) / 50_000 < 0.05
    assert abs(sum(r.output_tokens for r in day) / len(day) - 214.5) / 214.5 < 0.05
    assert abs(sum(r.prompt_tokens for r in day) / len(day) - 69.5) / 69.5 < 0.05
    hours = [0] * 24
    for r in day:
        hours[int(r.arrival_s // 3600) % 24] += 1
    assert hours[15] > 2 * hours[3]  # the peak at 15:00, the trough at 03:00 (3:1)
    assert day == bursty_day(traffic, WorkloadSettings(), 6)  # seeded
    assert {r.partition for r in day} == set(range(6))


def test_a_long_generation_holds_back_the_partitions_commit_but_not_a_share_groups_lag():
    # One long request, then short ones on the same partition: the consumer group's committed offset stays
    # at the long one (commit = lowest unfinished), so every later record counts in KEDA's lag while it runs.
    requests = [Request(0, 0.0, 0, 10, 400)] + [Request(i, 1.0 + i, 0, 10, 10) for i in range(1, 11)]
    part = Simulation(requests, WorkerParams(CURVE), replicas=1, sample_s=1.0)
    res = part.run()
    assert max(s.lag for s in res.samples) >= 9  # the short ones are long done, their offsets uncommitted
    share = Simulation(requests, WorkerParams(CURVE, intake="share"), replicas=1, sample_s=1.0).run()
    assert max(s.lag for s in share.samples) <= 4  # what is running or waiting, no more
