"""The HPA rule and KEDA's Kafka scaler, against the examples the Kubernetes and KEDA docs give."""

from __future__ import annotations

import pytest

from capacity.keda import HorizontalPodAutoscaler, ScaledObject, hpa_desired, kafka_lag_metric
from capacity.settings import ScalingSettings


def test_the_documented_doubling_and_halving():
    # kubernetes.io HPA "Algorithm details": current 200m for a desired 100m doubles the replicas, 50m halves them.
    # With an AverageValue external metric the total is per-pod average x replicas.
    assert hpa_desired(current=3, metric_total=200 * 3, target_average=100) == 6
    assert hpa_desired(current=4, metric_total=50 * 4, target_average=100) == 2


def test_the_documented_50_to_60_example():
    # Kubernetes v1.33 blog (configurable tolerance): 50 replicas at 90 for a target of 75 -> 60.
    assert hpa_desired(current=50, metric_total=90 * 50, target_average=75) == 60


def test_nothing_changes_within_the_tolerance():
    # 10 replicas at a target of 10 each: a total lag within 100 +- 10% keeps them.
    assert hpa_desired(10, 105, 10) == 10
    assert hpa_desired(10, 109, 10) == 10
    assert hpa_desired(10, 111, 10) == 12  # ratio 1.11: ceil(111 / 10)
    assert hpa_desired(10, 91, 10) == 10
    assert hpa_desired(10, 85, 10) == 9  # ceil(85 / 10)
    assert hpa_desired(10, 0, 10) == 0  # the HPA's min (>= 1) is applied after


def test_the_hpa_does_nothing_at_zero_replicas():
    with pytest.raises(ValueError):
        hpa_desired(0, 100, 10)
    assert HorizontalPodAutoscaler(ScalingSettings(lag_threshold=16)).reconcile(0.0, 0, 1000) == 0


def test_kedas_lag_is_capped_at_the_partitions_unless_idle_consumers_are_allowed():
    lags = [500, 500, 0, 0, 0, 0]
    assert kafka_lag_metric(lags, 10) == 60  # 6 partitions x lagThreshold: the HPA asks for 6 at most
    assert kafka_lag_metric(lags, 10, limit_to_partitions_with_lag=True) == 20
    assert kafka_lag_metric(lags, 10, allow_idle_consumers=True) == 1000
    assert kafka_lag_metric([3, 4, 0, 0, 0, 0], 10) == 7  # under the cap: the plain total


def test_scale_up_is_limited_to_the_larger_of_doubling_and_four_pods_per_period():
    hpa = HorizontalPodAutoscaler(ScalingSettings(lag_threshold=16, max_replicas=100))
    assert hpa.reconcile(0.0, 1, 10_000) == 5  # max(1 x 2, 1 + 4)
    assert hpa.reconcile(15.0, 5, 10_000) == 10  # max(5 x 2, 5 + 4)
    assert hpa.reconcile(30.0, 10, 10_000) == 20
    assert hpa.reconcile(45.0, 20, 10_000) == 40
    assert hpa.reconcile(60.0, 40, 10_000) == 80
    assert hpa.reconcile(75.0, 80, 10_000) == 100  # maxReplicas


def test_two_syncs_in_one_period_share_its_budget():
    hpa = HorizontalPodAutoscaler(ScalingSettings(lag_threshold=16, max_replicas=100))
    assert hpa.reconcile(0.0, 1, 10_000) == 5
    assert hpa.reconcile(5.0, 5, 10_000) == 5  # 4 pods already added in this 15 s period: start 1 -> at most 5


def test_scale_down_waits_for_the_stabilization_window():
    s = ScalingSettings(lag_threshold=16, max_replicas=20)
    hpa = HorizontalPodAutoscaler(s)
    assert hpa.reconcile(0.0, 10, 160) == 10  # 160 / 16 = 10: steady
    # The lag falls to nothing: the window holds the highest recommendation of the last 300 s (10).
    for t in range(15, 300, 15):
        assert hpa.reconcile(float(t), 10, 0) == 10
    assert hpa.reconcile(300.0, 10, 0) == 1  # the t=0 recommendation left the window; the HPA's min is 1


def test_a_shorter_window_scales_down_sooner():
    hpa = HorizontalPodAutoscaler(ScalingSettings(lag_threshold=16, max_replicas=20, scale_down_stabilization_s=30))
    assert hpa.reconcile(0.0, 8, 128) == 8
    assert hpa.reconcile(15.0, 8, 0) == 8
    assert hpa.reconcile(45.0, 8, 0) == 1


def test_scale_down_policy_percent():
    hpa = HorizontalPodAutoscaler(ScalingSettings(lag_threshold=16, max_replicas=20, scale_down_stabilization_s=0, scale_down_percent=50))
    assert hpa.reconcile(0.0, 8, 0) == 4  # -50% per 15 s
    assert hpa.reconcile(15.0, 4, 0) == 2
    assert hpa.reconcile(20.0, 2, 0) == 2  # 2 removed in this period already: start 4 -> 2


def test_keda_activates_from_zero_and_scales_to_zero_after_the_cooldown():
    so = ScaledObject(ScalingSettings(lag_threshold=16, min_replicas=0, cooldown_period_s=300, activation_lag_threshold=0))
    assert so.poll(0.0, 0, [0] * 6) == 0
    assert so.poll(30.0, 0, [1, 0, 0, 0, 0, 0]) == 1  # lag > activationLagThreshold: 0 -> 1
    assert so.poll(60.0, 1, [0] * 6) == 1  # inactive, but the last active check was 30 s ago
    assert so.poll(300.0, 1, [0] * 6) == 1
    assert so.poll(330.0, 1, [0] * 6) == 0  # 300 s after the last active check


def test_activation_threshold_is_strictly_greater_than():
    so = ScaledObject(ScalingSettings(lag_threshold=16, min_replicas=0, activation_lag_threshold=5))
    assert so.poll(0.0, 0, [5, 0, 0, 0, 0, 0]) == 0
    assert so.poll(30.0, 0, [6, 0, 0, 0, 0, 0]) == 1


def test_min_replicas_one_never_scales_to_zero():
    so = ScaledObject(ScalingSettings(lag_threshold=16, min_replicas=1))
    assert so.poll(10_000.0, 1, [0] * 6) == 1
    assert so.hpa.reconcile(10_000.0, 1, so.metric([0] * 6)) == 1


def test_invalid_combinations_are_refused():
    with pytest.raises(ValueError):
        ScalingSettings(min_replicas=5, max_replicas=2)
    with pytest.raises(ValueError):
        ScalingSettings(allow_idle_consumers=True, limit_to_partitions_with_lag=True)


def test_a_count_above_max_comes_down_to_max_at_once():
    hpa = HorizontalPodAutoscaler(ScalingSettings(lag_threshold=16, max_replicas=6))
    assert hpa.reconcile(0.0, 8, 0) == 6  # the HPA's first rule: current > maxReplicas -> maxReplicas


def test_an_unset_threshold_is_three_quarters_of_the_batch_as_rendered():
    from capacity.simulate import with_lag_threshold

    assert with_lag_threshold(ScalingSettings(), 32).lag_threshold == 24  # = k8s.keda.lag_per_worker
    assert with_lag_threshold(ScalingSettings(lag_threshold=7), 32).lag_threshold == 7
    with pytest.raises(ValueError, match="resolve it first"):
        HorizontalPodAutoscaler(ScalingSettings())
