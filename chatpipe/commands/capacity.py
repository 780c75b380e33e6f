"""``chatpipe capacity``: what a deployment needs for N users, and how KEDA scales the workers over a day.

- ``chatpipe capacity --users N --messages-per-user-day M``: partitions, brokers, streams workers,
  inference GPUs, Qdrant size and archive bytes per day, each with its arithmetic and the measured
  figure it comes from (``capacity/model.py``, ``capacity/figures.py``).
- ``chatpipe capacity simulate``: replays a bursty day (``capacity/traffic.py``) against KEDA's Kafka
  scaler and the HPA (``capacity/keda.py``) with the measured per-worker throughput
  (``capacity/simulate.py``); prints replicas over time, queue wait p50/p99 and GPU-hours.

Every flag is a field of a settings object (``capacity/settings.py``, ``CapacitySettings``), with its
``CHATPIPE_CAPACITY_*`` variable; the flags are built from the fields (``chatpipe/options.py``), so the
help texts, variables and defaults are theirs.
docs/deploy.md "Autoscaling" and "Capacity" explain the rules and the figures.
"""

from __future__ import annotations

import inspect
import math
import typing
from typing import Annotated, Callable, Optional

import typer

from chatpipe.commands.common import build_settings, console, with_parameters
from chatpipe.options import option

def _flag_params(cls) -> list[inspect.Parameter]:
    """One keyword parameter (a typer option defaulting to None: "not given") per settings field."""
    params = []
    for name, info in cls.model_fields.items():
        flag = "--" + name.replace("_", "-")
        annotation = info.annotation
        choices = typing.get_args(annotation) if typing.get_origin(annotation) is typing.Literal else ()
        help_ = f"{info.description} ({' | '.join(choices)})" if choices else None
        kind = Optional[annotation] if annotation in (bool, int, float) else Optional[str]
        if annotation is bool:
            flag = f"{flag}/--no-{flag[2:]}"
        # help, variable and default from the field (chatpipe/options.py)
        annotated = Annotated[kind, option(cls, name, flag, help=help_, show_default=False)]
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotated))
    return params


def _command(classes: tuple[type, ...], body: Callable[..., None], extra: list[inspect.Parameter] = ()) -> Callable:
    params = [p for cls in classes for p in _flag_params(cls)] + list(extra)

    def command(**values) -> None:
        settings = []
        for cls in classes:
            names = cls.model_fields.keys()
            settings.append(build_settings(cls, **{k: v for k, v in values.items() if k in names}))
        body(*settings, **{p.name: values[p.name] for p in extra})

    command.__doc__ = body.__doc__
    return with_parameters(command, params)


def _plan(capacity, workload, traffic) -> None:
    """Partitions, brokers, streams workers, GPUs, Qdrant and archive for N users (each line: its arithmetic
    and the measured figure it stands on)."""
    from capacity.model import plan

    console.print(f"chatpipe capacity: {capacity.users:,} weekly users x {capacity.messages_per_user_day:g} "
                  f"messages per user-day; LMSYS-shaped exchanges ({workload.prompt_tokens:g} prompt / "
                  f"{workload.answer_tokens:g} answer tokens); a {traffic.peak_to_trough:g}:1 day, flash crowds "
                  f"x{traffic.burst_multiplier:g}; utilization {capacity.utilization:g}", highlight=False, soft_wrap=True)
    console.print("labels: CPU = measured on this project's 2-core VM; GPU = README 'GPU' (one H200, bf16, "
                  "random-init Llama shapes); public = cited in docs/deploy.md 'Capacity'\n", highlight=False,
                  soft_wrap=True)
    for line in plan(capacity, workload, traffic).lines:
        console.print(line.render(), highlight=False, soft_wrap=True, markup=False)


def _clock(seconds: float) -> str:
    h, rem = divmod(int(round(seconds)), 3600)
    return f"{h:02d}:{rem // 60:02d}"


def _simulate(workload, traffic, scaling, worker, *, step_minutes: float = 60.0) -> None:
    """Replay a bursty day against KEDA's scaling rule: replicas over time, queue wait p50/p99, GPU-hours."""
    from capacity import figures as F
    from capacity.simulate import Curve, WorkerParams, percentile, simulate, with_lag_threshold
    from capacity.traffic import bursty_day, peak_to_mean

    curve: Curve = F.CURVES[worker.curve]
    pod_start = worker.pod_start_s if worker.pod_start_s >= 0 else F.WORKER_START_S.value
    join = worker.join_s if worker.join_s >= 0 else F.JOIN_S.value
    params = WorkerParams(curve, max_batch=worker.max_batch, pod_start_s=pod_start, join_s=join,
                          intake=worker.intake, grace_s=worker.grace_s)
    scaling = with_lag_threshold(scaling, params.batch)
    requests = bursty_day(traffic, workload, scaling.partitions)
    cap = "" if scaling.allow_idle_consumers or worker.intake == "share" else \
        f", so at most {min(scaling.partitions, scaling.max_replicas)} replicas (allowIdleConsumers false)"
    console.print(
        f"chatpipe capacity simulate: {len(requests):,} prompts over {traffic.hours:g} h (a {traffic.peak_to_trough:g}:1 "
        f"day peaking at {traffic.peak_hour:g}:00, x{peak_to_mean(traffic):.2f} of the mean; {traffic.bursts} flash "
        f"crowds x{traffic.burst_multiplier:g} for {traffic.burst_minutes:g} min; Gamma arrivals, shape "
        f"{traffic.burstiness:g}); answers {workload.answer_tokens:g} tokens on average\n"
        f"worker: {curve.label}: {', '.join(f'{r:.0f} tok/s at {k}' for k, r in curve.points)}; max batch "
        f"{params.batch}; pod start {pod_start:g} s{' (measured, CPU)' if worker.pod_start_s < 0 else ''}; rebalance "
        f"{join:g} s; {worker.intake} intake over {scaling.partitions} partitions\n"
        f"KEDA: lagThreshold {scaling.lag_threshold:g}, activationLagThreshold {scaling.activation_lag_threshold:g}, "
        f"pollingInterval {scaling.polling_interval_s:g} s, cooldownPeriod {scaling.cooldown_period_s:g} s, replicas "
        f"{scaling.min_replicas}-{scaling.max_replicas}{cap}; HPA: sync {scaling.hpa_sync_period_s:g} s, tolerance "
        f"{scaling.tolerance:g}, scale-down stabilization {scaling.scale_down_stabilization_s:g} s, scale-up "
        f"max(+{scaling.scale_up_percent:g}%, +{scaling.scale_up_pods}) per {scaling.policy_period_s:g} s",
        highlight=False, soft_wrap=True)
    result = simulate(requests, params, partitions=scaling.partitions, scaling=scaling)
    waits = result.queue_waits()
    lat = result.latencies()
    step = step_minutes * 60
    console.print(f"\n{'time':>5}  {'prompts/s':>9}  {'replicas':>8}  {'lag':>6}  {'queue wait p50 / p99 s':>22}  "
                  f"{'latency p50 s':>13}", highlight=False)
    arrived: dict[int, list[int]] = {}  # row -> the requests that arrived in its step
    for i, request in enumerate(requests):
        arrived.setdefault(int(request.arrival_s // step), []).append(i)
    for row in range(math.ceil(traffic.hours * 3600 / step)):
        t = row * step
        ids = arrived.get(row, [])
        samples = [s for s in result.samples if t <= s.t < t + step]
        pods = f"{min(s.pods for s in samples)}-{max(s.pods for s in samples)}" if samples else "-"
        lag = max((s.lag for s in samples), default=0.0)
        w = [waits[i] for i in ids]
        latency = [lat[i] for i in ids]
        console.print(f"{_clock(t):>5}  {len(ids) / step:9.2f}  {pods:>8}  {lag:6.0f}  "
                      f"{percentile(w, .5):9.2f} / {percentile(w, .99):8.2f}  {percentile(latency, .5):13.1f}",
                      highlight=False)
    hours = result.gpu_hours(worker.gpus_per_worker)
    console.print(
        f"\nqueue wait (produced to engine admission): p50 {percentile(waits, .5):.2f} s, p99 {percentile(waits, .99):.2f} s, "
        f"max {max(waits):.1f} s; latency p50 {percentile(lat, .5):.1f} s, p99 {percentile(lat, .99):.1f} s\n"
        f"replicas {result.min_pods}-{result.max_pods}; GPU-hours {hours:,.1f} ({worker.gpus_per_worker} per worker; "
        f"static at the max: {result.max_pods * worker.gpus_per_worker * (result.end_s / 3600):,.1f}); moves and drains "
        f"restarted {result.restarts:,} running requests, {result.duplicates:,} answered twice",
        highlight=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    from capacity.model import CapacitySettings
    from capacity.settings import ScalingSettings, TrafficSettings, WorkerModelSettings, WorkloadSettings

    group = typer.Typer(help="Capacity: what N users need (`chatpipe capacity --users N`), and a day of KEDA "
                        "autoscaling (`chatpipe capacity simulate`).", invoke_without_command=True)
    def plan_unless_a_subcommand(capacity, workload, traffic, *, ctx: typer.Context) -> None:
        if ctx.invoked_subcommand is None:
            _plan(capacity, workload, traffic)

    ctx = inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)
    callback = _command((CapacitySettings, WorkloadSettings, TrafficSettings), plan_unless_a_subcommand, [ctx])
    callback.__doc__ = _plan.__doc__
    group.callback(invoke_without_command=True)(callback)

    step = inspect.Parameter("step_minutes", inspect.Parameter.KEYWORD_ONLY, annotation=float,
                             default=typer.Option(60.0, "--step-minutes", min=1.0, help="Minutes per row of the timeline"))
    group.command("simulate")(_command((WorkloadSettings, TrafficSettings, ScalingSettings, WorkerModelSettings),
                                       _simulate, [step]))
    app.add_typer(group, name="capacity")
