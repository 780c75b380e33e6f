"""Typed settings of the simulation and of the capacity model (env prefix ``CHATPIPE_CAPACITY_``).

Every field says what it is and where its default comes from. Defaults of the scaling rule are KEDA's
and Kubernetes' own (docs/deploy.md "Autoscaling" cites them); defaults of the workload are public
figures (LMSYS-Chat-1M, "How People Use ChatGPT"); per-worker throughput and pod start default to the
figures this project measured (``capacity/figures.py``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

CAPACITY_CONFIG = SettingsConfigDict(env_prefix="CHATPIPE_CAPACITY_", frozen=True, extra="forbid")  # capacity.model too


class WorkloadSettings(BaseSettings):
    """What one request looks like (LMSYS-Chat-1M, Zheng et al. 2023, arXiv:2309.11998, Table 1)."""

    model_config = CAPACITY_CONFIG

    prompt_tokens: float = Field(69.5, gt=0, description="Mean tokens per user prompt (LMSYS-Chat-1M: 69.5)")
    answer_tokens: float = Field(214.5, gt=0, description="Mean tokens per answer (LMSYS-Chat-1M: 214.5)")
    turns_per_conversation: float = Field(2.0, ge=1, description="Mean turns per conversation (LMSYS-Chat-1M: 2.0)")
    length_sigma: float = Field(0.8, ge=0, description="Sigma of the log-normal token lengths (an assumption: "
                                "long-tailed like chat logs; the means stay the figures above)")
    max_answer_tokens: int = Field(2048, ge=1, description="Longest answer drawn (the context size)")
    think_time_s: float = Field(45.0, ge=0, description="Mean seconds between two turns of a conversation "
                                "(exponential; an assumption: reading the answer, typing the next prompt)")


class TrafficSettings(BaseSettings):
    """The day's shape: a diurnal curve, bursty (Gamma) arrivals, a few flash crowds."""

    model_config = CAPACITY_CONFIG

    messages_per_day: int = Field(400_000, ge=1, description="Prompts in the simulated day (users x messages per "
                                  "user-day; 400k = ~108k weekly users at 3.7 messages each)")
    peak_to_trough: float = Field(3.0, ge=1, description="Diurnal peak rate / trough rate (an assumption in the "
                                  "range of public chat-service traces; 1 = flat)")
    peak_hour: float = Field(15.0, ge=0, lt=24, description="Hour of the diurnal peak (UTC of the simulated day)")
    burstiness: float = Field(0.5, gt=0, description="Shape of the Gamma inter-arrival times of conversations "
                              "(1 = Poisson; < 1 burstier; BurstGPT, arXiv:2401.17644, models its traces so)")
    bursts: int = Field(3, ge=0, description="Flash crowds in the day (seeded random times)")
    burst_multiplier: float = Field(2.0, ge=1, description="Arrival rate during a flash crowd / the curve's rate")
    burst_minutes: float = Field(10.0, gt=0, description="Length of one flash crowd, minutes")
    hours: float = Field(24.0, gt=0, le=168, description="Length of the simulated traffic, hours")
    seed: int = Field(7, description="Seed of everything random in the day")


class ScalingSettings(BaseSettings):
    """KEDA's ScaledObject with the Kafka trigger, and the HPA KEDA creates for it."""

    model_config = CAPACITY_CONFIG

    # KEDA ScaledObject (keda.sh/docs/latest/reference/scaledobject-spec)
    min_replicas: int = Field(1, ge=0, description="ScaledObject minReplicaCount (`chatpipe k8s render`: 1, a warm "
                              "worker; KEDA's default 0 scales to zero)")
    max_replicas: int = Field(12, ge=1, description="ScaledObject maxReplicaCount (`chatpipe k8s render`: 12; "
                              "KEDA's default 100); partition intake stops at the partitions anyway")
    polling_interval_s: float = Field(15.0, gt=0, description="pollingInterval: how often KEDA checks the trigger "
                                      "for activation, 0 <-> 1 (`chatpipe k8s render`: 15; KEDA's default 30)")
    cooldown_period_s: float = Field(300.0, ge=0, description="cooldownPeriod: seconds after the last active check "
                                     "before scaling to 0 (only with min_replicas 0); default 300")
    # Kafka trigger (keda.sh/docs/latest/scalers/apache-kafka)
    lag_threshold: float = Field(0.0, ge=0, description="lagThreshold (Kafka scaler) / threshold (Prometheus "
                                 "scaler): target lag per replica, the HPA's AverageValue target; 0 = 3/4 of the "
                                 "worker's max batch, as `chatpipe k8s render` sets it (KEDA's default 10). The lag "
                                 "counts running requests too: the worker acknowledges after the answer")
    activation_lag_threshold: float = Field(0.0, ge=0, description="activationLagThreshold: lag above which the "
                                            "scaler is active (0 -> 1); default 0")
    allow_idle_consumers: bool = Field(False, description="allowIdleConsumers: false caps the metric so replicas "
                                       "never exceed the partitions (KEDA's default)")
    limit_to_partitions_with_lag: bool = Field(False, description="limitToPartitionsWithLag: cap at the partitions "
                                               "that have lag instead")
    partitions: int = Field(6, ge=1, description="Partitions of chat.inference.requests (the catalog: 6)")
    # Kubernetes HPA (kubernetes.io/docs/tasks/run-application/horizontal-pod-autoscale)
    hpa_sync_period_s: float = Field(15.0, gt=0, description="--horizontal-pod-autoscaler-sync-period (15 s); the "
                                     "HPA asks KEDA for the lag this often (no useCachedMetrics)")
    tolerance: float = Field(0.1, ge=0, lt=1, description="HPA tolerance: no change while |metric/target - 1| <= it")
    scale_up_stabilization_s: float = Field(0.0, ge=0, le=3600, description="behavior.scaleUp."
                                            "stabilizationWindowSeconds (default 0)")
    scale_down_stabilization_s: float = Field(300.0, ge=0, le=3600, description="behavior.scaleDown."
                                              "stabilizationWindowSeconds (default 300)")
    scale_up_percent: float = Field(100.0, ge=0, description="Default scaleUp policy: +100% per period")
    scale_up_pods: int = Field(4, ge=0, description="Default scaleUp policy: +4 pods per period (the larger wins)")
    scale_down_percent: float = Field(100.0, ge=0, le=100, description="Default scaleDown policy: -100% per period")
    policy_period_s: float = Field(15.0, gt=0, description="periodSeconds of the default policies")

    @model_validator(mode="after")
    def _check(self) -> "ScalingSettings":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        if self.allow_idle_consumers and self.limit_to_partitions_with_lag:
            raise ValueError("allow_idle_consumers and limit_to_partitions_with_lag cannot both be set (KEDA refuses it)")
        return self


class WorkerModelSettings(BaseSettings):
    """One inference worker as the simulation sees it."""

    model_config = CAPACITY_CONFIG

    curve: Literal["gpu-8b", "gpu-1b", "cpu"] = Field(
        "gpu-8b", description="Per-worker throughput curve (capacity/figures.py): gpu-8b / gpu-1b = README 'GPU' "
        "(H200, bf16, random-init Llama shapes), cpu = bench/capacity.py on this project's 2-core VM")
    max_batch: int = Field(0, ge=0, description="Engine max batch; 0 = the curve's largest measured batch")
    pod_start_s: float = Field(-1.0, description="Seconds from pod created to consuming (model load); < 0 = the "
                               "measured worker start of bench/capacity.py (CPU; a GPU node adds image pull and "
                               "weights load: set it)")
    join_s: float = Field(-1.0, description="Seconds a joining or leaving member's partitions pause (the group's "
                          "rebalance); < 0 = the figure measured by bench/capacity.py")
    intake: Literal["partition", "share"] = Field("share", description="share: any worker takes any record "
                                                  "(`chatpipe k8s render`'s default); partition: a consumer group (one "
                                                  "worker per partition; rebalances restart moved work)")
    grace_s: float = Field(20.0, ge=0, description="SIGTERM grace of a worker scaled down (WorkerSettings.grace_s)")
    gpus_per_worker: int = Field(1, ge=1, description="GPUs one worker holds (GPU-hours = pod-hours x this)")
