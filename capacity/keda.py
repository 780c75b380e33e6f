"""KEDA's Kafka scaler and the Kubernetes HPA's rule, computed the way the controllers compute them.

Sources (docs/deploy.md "Autoscaling" links them):

- KEDA's Kafka scaler (``pkg/scalers/kafka_scaler.go``, ``getTotalLag``): the metric is the group's total
  lag, the sum over partitions of (end offset - committed offset); unless ``allowIdleConsumers``, it is
  capped at ``partitions x lagThreshold`` (``limitToPartitionsWithLag``: at partitions-with-lag x
  threshold), so the HPA never asks for more replicas than partitions. Active when the lag is above
  ``activationLagThreshold``. The HPA target is ``AverageValue = lagThreshold``.
- The HPA (``pkg/controller/podautoscaler``: ``GetExternalPerPodMetricReplicas``,
  ``stabilizeRecommendationWithBehaviors``, ``convertDesiredReplicasWithBehaviorRate``): for an
  AverageValue external metric, usage ratio = total / (target x current replicas); within the
  tolerance (0.1) nothing changes, else desired = ceil(total / target) (the documented
  ``ceil(current x metric / target)`` with the per-pod average). Then the stabilization windows
  (scale up: the lowest recommendation of the window, default 0 s; scale down: the highest, default
  300 s), then the rate policies (default up: max(+100%, +4 pods) per 15 s; down: -100% per 15 s),
  then [minReplicas, maxReplicas]. At 0 replicas the HPA does nothing.
- KEDA's scale loop (``pkg/scaling/executor/scale_scaledobjects.go``), every ``pollingInterval``:
  active and 0 replicas -> max(minReplicaCount, 1); not active, replicas > 0, minReplicaCount 0 and the
  last active check more than ``cooldownPeriod`` ago -> 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from capacity.settings import ScalingSettings


def kafka_lag_metric(partition_lags: Sequence[int], lag_threshold: float, *, allow_idle_consumers: bool = False,
                     limit_to_partitions_with_lag: bool = False) -> float:
    """The value KEDA's Kafka scaler hands the HPA: the total lag, capped as ``getTotalLag`` caps it."""
    total = float(sum(partition_lags))
    if not allow_idle_consumers or limit_to_partitions_with_lag:
        upper = sum(1 for lag in partition_lags if lag > 0) if limit_to_partitions_with_lag else len(partition_lags)
        if total / lag_threshold > upper:  # Go: integer division of int64s; equal for the integral lags here
            total = upper * lag_threshold
    return total


def default_lag_threshold(max_batch: int) -> int:
    """The target lag per worker when none is given: 3/4 of the engine's max batch. The lag counts
    running requests too, so a target below a full batch adds a worker before the batches are full,
    and one at or above it lets a queue form first (docs/deploy.md "Autoscaling", the simulated day).
    ``chatpipe k8s render`` and ``chatpipe capacity simulate`` both use it."""
    return max(1, round(0.75 * max_batch))


def hpa_desired(current: int, metric_total: float, target_average: float, tolerance: float = 0.1) -> int:
    """Replicas the HPA's replica calculator proposes for an AverageValue external metric."""
    if current <= 0:
        raise ValueError("the HPA computes nothing at 0 replicas (KEDA activates from 0)")
    ratio = metric_total / (target_average * current)
    if abs(1.0 - ratio) <= tolerance:
        return current
    return math.ceil(metric_total / target_average)


@dataclass
class HorizontalPodAutoscaler:
    """One HPA (the one KEDA creates), with its recommendation and scale-event history."""

    s: ScalingSettings
    recommendations: list[tuple[float, int]] = field(default_factory=list)  # (time, unstabilized desired)
    up_events: list[tuple[float, int]] = field(default_factory=list)  # (time, replicas added)
    down_events: list[tuple[float, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.s.lag_threshold <= 0:
            raise ValueError("lag_threshold 0 stands for 3/4 of the worker's max batch: resolve it first "
                             "(capacity.simulate.with_lag_threshold)")

    @property
    def min_replicas(self) -> int:
        return max(1, self.s.min_replicas)  # KEDA gives the HPA minReplicas >= 1

    def reconcile(self, now: float, current: int, metric_total: float) -> int:
        """The replica count after one sync at ``now`` (``current`` when nothing changes)."""
        if current == 0:
            return 0
        if current > self.s.max_replicas:
            desired = self.s.max_replicas
        elif current < self.min_replicas:
            desired = self.min_replicas
        else:
            proposal = hpa_desired(current, metric_total, self.s.lag_threshold, self.s.tolerance)
            desired = self._stabilize(now, current, proposal)
            desired = self._rate_limit(now, current, desired)
        if desired > current:
            self.up_events.append((now, desired - current))
        elif desired < current:
            self.down_events.append((now, current - desired))
        return desired

    def _stabilize(self, now: float, current: int, proposal: int) -> int:
        up_cut = now - self.s.scale_up_stabilization_s
        down_cut = now - self.s.scale_down_stabilization_s
        up, down = proposal, proposal
        for t, rec in self.recommendations:
            if t > up_cut:
                up = min(up, rec)
            if t > down_cut:
                down = max(down, rec)
        keep = now - max(self.s.scale_up_stabilization_s, self.s.scale_down_stabilization_s)
        self.recommendations = [(t, r) for t, r in self.recommendations if t > keep]
        self.recommendations.append((now, proposal))
        return min(max(current, up), down)

    @staticmethod
    def _change_in_period(events: list[tuple[float, int]], now: float, period: float) -> int:
        while events and events[0][0] <= now - period:  # older events never count again: drop them
            events.pop(0)
        return sum(n for t, n in events if t > now - period)

    def _rate_limit(self, now: float, current: int, desired: int) -> int:
        s = self.s
        period = s.policy_period_s
        added = self._change_in_period(self.up_events, now, period)
        removed = self._change_in_period(self.down_events, now, period)
        start = current - added + removed  # the replicas at the start of the period
        if desired > current:
            limits = [math.ceil(start * (1 + s.scale_up_percent / 100)), start + s.scale_up_pods]
            limit = max(max(limits), current)  # selectPolicy Max: the policy allowing the most
            return min(desired, s.max_replicas, limit)
        if desired < current:
            limit = min(int(start * (1 - s.scale_down_percent / 100)), current)
            return max(desired, self.min_replicas, limit)
        return desired


@dataclass
class ScaledObject:
    """KEDA's part: activation 0 <-> 1 every polling interval; the HPA does 1 <-> N."""

    s: ScalingSettings
    hpa: HorizontalPodAutoscaler = field(init=False)
    last_active: float = -math.inf

    def __post_init__(self) -> None:
        self.hpa = HorizontalPodAutoscaler(self.s)

    def metric(self, partition_lags: Sequence[int]) -> float:
        return kafka_lag_metric(partition_lags, self.s.lag_threshold, allow_idle_consumers=self.s.allow_idle_consumers,
                                limit_to_partitions_with_lag=self.s.limit_to_partitions_with_lag)

    def poll(self, now: float, current: int, partition_lags: Sequence[int]) -> int:
        """KEDA's check every pollingInterval: the replica count it sets (``current`` if none)."""
        active = sum(partition_lags) > self.s.activation_lag_threshold
        if self.s.min_replicas >= 1:  # "If the minimum replicas is >= 1, the scaler is always active"
            return max(current, self.s.min_replicas)
        if active:
            self.last_active = now
            return max(1, self.s.min_replicas) if current == 0 else current
        if current > 0 and now - self.last_active >= self.s.cooldown_period_s:
            return 0
        return current
