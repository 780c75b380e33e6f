"""The capacity model: from users and messages per user-day to partitions, brokers, streams workers,
inference GPUs, Qdrant size and archive bytes per day, each line with its arithmetic and the measured
figure it stands on (``capacity/figures.py``; CPU = this project's 2-core VM, GPU = the H200 of docs/benchmarks.md).

Traffic at the sizing peak = mean x the diurnal peak-to-mean (``TrafficSettings.peak_to_trough``) x the
flash-crowd multiplier: what Kafka's partitions and brokers (which do not autoscale) must carry.
GPU-hours per day follow the mean (autoscaled workers track the curve), GPUs at the peak set
``maxReplicaCount`` and, with partition intake, the partition count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pydantic import Field
from pydantic_settings import BaseSettings

from capacity import figures as F
from capacity.settings import CAPACITY_CONFIG, TrafficSettings, WorkloadSettings
from capacity.traffic import peak_to_mean
from schemas.topics import BY_NAME, DAY_MS

GIB = 1024**3
TIB = 1024**4


class CapacitySettings(BaseSettings):
    """Inputs of ``chatpipe capacity`` besides the workload and the day's shape."""

    model_config = CAPACITY_CONFIG

    users: int = Field(1_000_000, ge=1, description="Weekly active users")
    messages_per_user_day: float = Field(3.7, gt=0, description="Prompts per weekly active user per day (ChatGPT, "
                                         "July 2025: 18 billion messages a week from 700 million weekly users, "
                                         "Chatterji et al., NBER w34255: 18e9 / 7 / 700e6 = 3.7)")
    gpu_shape: str = Field("gpu-8b", pattern="^(gpu-8b|gpu-1b)$", description="Which README 'GPU' figure sizes the "
                           "GPUs: gpu-8b (Llama-3.1-8B shape) or gpu-1b")
    utilization: float = Field(0.7, gt=0, le=1, description="Share of a measured peak rate a unit is planned to "
                               "carry (headroom for queueing; check it with `chatpipe capacity simulate`)")
    replication_factor: int = Field(3, ge=1, description="Kafka copies of each partition (the catalog's rule on "
                                    ">= 3 brokers)")
    broker_cores: int = Field(8, ge=1, description="CPU cores per broker machine")
    broker_network_mib_s: float = Field(1190.0, gt=0, description="Network per broker machine, MiB/s each way "
                                        "(10 Gbit/s)")
    broker_disk_tib: float = Field(8.0, gt=0, description="Log disk per broker machine, TiB")
    memory_retention_days: float = Field(365.0, gt=0, description="Days of turns kept in memory (Qdrant; nothing "
                                         "expires them but an erasure)")
    qdrant_replication: int = Field(2, ge=1, description="Copies of each Qdrant shard (a cluster that survives one "
                                    "peer: 2; MemorySettings.replication_factor)")
    recalled_share: float = Field(1.0, ge=0, le=1, description="Share of inference requests whose context carries "
                                  "4 recalled turns (identified users with history); the rest carry the prompt only")


@dataclass
class Line:
    name: str
    value: float  # in ``unit``; bytes for the byte lines
    unit: str
    arithmetic: str
    source: str  # figure(s) used, labelled

    def render(self) -> str:
        shown = size(self.value) if self.unit == "bytes" else f"{fmt(self.value)} {self.unit}"
        return f"{self.name}: {shown}\n    = {self.arithmetic}\n    [{self.source}]"


@dataclass
class Plan:
    lines: list[Line] = field(default_factory=list)

    def add(self, name: str, value: float, unit: str, arithmetic: str, source: str) -> float:
        self.lines.append(Line(name, value, unit, arithmetic, source))
        return value

    def __getitem__(self, name: str) -> Line:
        return next(line for line in self.lines if line.name == name)


def fmt(x: float) -> str:
    if x == int(x) and abs(x) < 1e15:
        return f"{int(x):,}"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 1:
        return f"{x:,.2f}"
    return f"{x:.3g}"


def size(nbytes: float) -> str:
    for unit, scale in (("PiB", 1024**5), ("TiB", TIB), ("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes:,.0f} B"


def plan(s: CapacitySettings, workload: WorkloadSettings | None = None,
         traffic: TrafficSettings | None = None) -> Plan:
    w = workload or WorkloadSettings()
    t = traffic or TrafficSettings()
    p = Plan()
    sz = F.SIZES
    # -- traffic -------------------------------------------------------------------------------------
    per_day = p.add("messages per day", s.users * s.messages_per_user_day, "prompts",
                    f"{fmt(s.users)} users x {fmt(s.messages_per_user_day)} messages per user-day",
                    "public: NBER w34255 (ChatGPT, July 2025); docs/deploy.md 'Capacity'")
    mean = p.add("mean rate", per_day / 86_400, "prompts/s", f"{fmt(per_day)} / 86,400 s", "arithmetic")
    diurnal = peak_to_mean(t)
    peak = p.add("diurnal peak", mean * diurnal, "prompts/s",
                 f"{fmt(mean)} x {diurnal:.2f} (peak/mean of a {t.peak_to_trough:g}:1 peak-to-trough day)",
                 "assumption: TrafficSettings.peak_to_trough")
    burst = p.add("sizing peak (flash crowd at the diurnal peak)", peak * t.burst_multiplier, "prompts/s",
                  f"{fmt(peak)} x {t.burst_multiplier:g} (TrafficSettings.burst_multiplier)",
                  "assumption: for what does not autoscale (partitions, brokers)")
    out_peak = p.add("output tokens/s at the diurnal peak", peak * w.answer_tokens, "tokens/s",
                     f"{fmt(peak)} x {w.answer_tokens:g} tokens per answer", "public: LMSYS-Chat-1M mean answer")
    out_mean = mean * w.answer_tokens
    # -- inference -------------------------------------------------------------------------------------
    curve = F.CURVES[s.gpu_shape]
    gpu_rate = curve.rate(curve.max_batch)
    gpus = p.add("inference GPUs at the diurnal peak", math.ceil(out_peak / (gpu_rate * s.utilization)), "GPUs",
                 f"ceil({fmt(out_peak)} tokens/s / ({fmt(gpu_rate)} tokens/s per GPU at batch {curve.max_batch} x "
                 f"{s.utilization:g} utilization))", f"GPU: {curve.label}; {F.GPU_SOURCE}")
    gpus_burst = p.add("inference GPUs in a flash crowd at the peak",
                       math.ceil(out_peak * t.burst_multiplier / (gpu_rate * s.utilization)), "GPUs",
                       f"ceil({fmt(out_peak)} x {t.burst_multiplier:g} / ({fmt(gpu_rate)} x {s.utilization:g}))",
                       "the maxReplicaCount that absorbs a flash crowd without queueing (GPU figure as above)")
    p.add("GPU-hours per day (autoscaled)", out_mean * 86_400 / (gpu_rate * s.utilization) / 3600, "GPU-hours",
          f"{fmt(out_mean)} mean tokens/s x 24 h / ({fmt(gpu_rate)} x {s.utilization:g}) tokens/s per GPU",
          "GPU figure as above; workers follow the mean (bursts and pod start come on top: simulate them)")
    p.add("GPU-hours per day (static at the peak)", gpus * 24, "GPU-hours", f"{fmt(gpus)} GPUs x 24 h",
          "the same count held all day, for comparison")
    cpu_rate = F.CPU.rate(F.CPU.max_batch)
    p.add("CPU inference workers at the diurnal peak (this machine's model)", math.ceil(out_peak / (cpu_rate * s.utilization)),
          "workers", f"ceil({fmt(out_peak)} / ({fmt(cpu_rate)} tokens/s per 1-thread worker x {s.utilization:g}))",
          f"CPU: {F.CPU.label}; {F.CPU_RUN}; SmolLM2-135M, not a model of the size above: for contrast only")
    # -- streams ---------------------------------------------------------------------------------------
    per_msg_s = 1 / F.STREAMS_INTAKE.value + 1 / F.STREAMS_RECORD.value
    streams = p.add("streams workers (2 cores each) at the sizing peak", math.ceil(burst * per_msg_s / s.utilization),
                    "workers", f"ceil({fmt(burst)} prompts/s x (1/{F.STREAMS_INTAKE.value:g} + 1/"
                    f"{F.STREAMS_RECORD.value:g}) s per prompt / {s.utilization:g}): intake + record of each exchange",
                    f"{F.STREAMS_INTAKE.cite()}; {F.STREAMS_RECORD.cite()}")
    # -- partitions --------------------------------------------------------------------------------------
    client_limit = math.ceil(burst / (F.CLIENT_CONSUME.value * s.utilization))
    need = max(streams, client_limit)
    p.add("partitions of the streams topics", 6 * math.ceil(need / 6), "partitions",
          f"max(streams workers {fmt(streams)}, ceil({fmt(burst)} / ({fmt(F.CLIENT_CONSUME.value)} x "
          f"{s.utilization:g})) = {client_limit} for one consumer per partition), rounded up to a multiple of 6",
          f"the count above; {F.CLIENT_CONSUME.cite()}. chat.prompts, chat.responses, chat.turns, chat.feedback, "
          "chat.deletions.fanout and the changelog: one count, fixed before the first prompt (docs/deploy.md)")
    p.add("partitions of chat.inference.requests (partition intake)", 6 * math.ceil(gpus_burst / 6), "partitions",
          f"ceil({fmt(gpus_burst)} GPUs in a flash crowd / 6) x 6: one worker per partition, and KEDA caps the "
          "replicas at the partitions (allowIdleConsumers false)",
          "the flash-crowd GPU count above; share intake (--intake share) needs no more than the streams topics")
    # -- Kafka brokers ------------------------------------------------------------------------------------
    # one chunk per text increment, measured per answer token; + the end marker
    chunks = sz["TokenChunks per answer"] / sz["answer tokens per turn"] * w.answer_tokens + 1
    infer_bytes = (s.recalled_share * sz["InferenceRequest (4 recalled turns)"]
                   + (1 - s.recalled_share) * sz["InferenceRequest (prompt only)"])
    topics = {  # records per prompt, bytes per record (value + headers)
        "chat.prompts": (1, sz["PromptRequest"]),
        "chat.inference.requests": (1, infer_bytes),
        "chat.replies": (chunks, sz["TokenChunk"]),
        "chat.responses": (1, sz["Response"]),
        "chat.turns": (1, sz["ConversationTurn"]),
    }
    hdr = sz["Kafka headers per record (traceparent)"]
    rec_per_prompt = sum(n for n, _ in topics.values())
    bytes_per_prompt = sum(n * (b + hdr) for n, b in topics.values())
    records = p.add("Kafka records/s at the sizing peak", burst * rec_per_prompt, "records/s",
                    f"{fmt(burst)} prompts/s x {rec_per_prompt:.1f} records per prompt (prompt, inference request, "
                    f"{chunks:.1f} token chunks, response, turn)", f"CPU: {F.SIZES_SOURCE}")
    ingress = p.add("Kafka ingress at the sizing peak (per second)", burst * bytes_per_prompt, "bytes",
                    f"{fmt(burst)} x {fmt(bytes_per_prompt)} bytes per prompt (records + traceparent headers, "
                    "before lz4)", f"CPU: {F.SIZES_SOURCE}")
    retained = sum(per_day * n * (b + hdr) * (BY_NAME[name].retention_ms / DAY_MS) * s.replication_factor
                   for name, (n, b) in topics.items())
    p.add("Kafka disk (retention x replication)", retained, "bytes",
          f"sum over topics of prompts/day x records x bytes x retention days (catalog: chat.turns 30, "
          f"chat.responses 7, chat.prompts and chat.inference.requests 1, chat.replies 1/24) x RF "
          f"{s.replication_factor}, before lz4", f"CPU: {F.SIZES_SOURCE}; schemas/topics.py retention")
    prod, cons = F.BROKER_PRODUCE_CPU.value, F.BROKER_CONSUME_CPU.value
    rf = s.replication_factor
    per_record = rf * prod + rf * cons  # appends on rf replicas; reads by rf - 1 followers and one consumer
    cores = records * per_record / 1e6
    by_cpu = math.ceil(cores / (s.broker_cores * s.utilization))
    by_net = math.ceil(ingress * 2 * rf / 2**20 / (s.broker_network_mib_s * s.utilization))
    by_disk = math.ceil(retained / TIB / (s.broker_disk_tib * s.utilization))
    p.add("Kafka brokers", max(rf, by_cpu, by_net, by_disk), "brokers",
          f"max(RF {rf}; CPU ceil({fmt(records)} records/s x ({rf} x {prod:.2f} + {rf} x {cons:.2f}) CPU-s per "
          f"million / 1e6 = {fmt(cores)} cores / ({s.broker_cores} x {s.utilization:g})) = {by_cpu}; network "
          f"ceil({size(ingress)}/s x 2 x {rf} (replica writes in, follower and consumer reads out) / "
          f"({fmt(s.broker_network_mib_s)} MiB/s x {s.utilization:g})) = {by_net}; disk ceil({size(retained)} / "
          f"({s.broker_disk_tib:g} TiB x {s.utilization:g})) = {by_disk})",
          f"{F.BROKER_PRODUCE_CPU.cite()}; {F.BROKER_CONSUME_CPU.cite()}; network and disk per machine: "
          "assumptions (--broker-network-mib-s, --broker-disk-tib)")
    # -- memory (Qdrant) ------------------------------------------------------------------------------------
    vectors = per_day * s.memory_retention_days
    ram = vectors * F.EMBEDDING_DIM.value * 4 * F.QDRANT_OVERHEAD.value * s.qdrant_replication
    p.add("Qdrant points added per day", per_day, "points", "one point per answered turn (streams record agent)",
          "streams/memory.py")
    p.add("Qdrant RAM for the vectors", ram, "bytes",
          f"{fmt(vectors)} points ({s.memory_retention_days:g} days) x {F.EMBEDDING_DIM.value:g} dims x 4 bytes x "
          f"{F.QDRANT_OVERHEAD.value:g} x {s.qdrant_replication} copies",
          f"{F.QDRANT_OVERHEAD.cite()}; {F.EMBEDDING_DIM.cite()}")
    payload = vectors * sz["Qdrant payload (JSON)"] * s.qdrant_replication
    p.add("Qdrant payload on disk", payload, "bytes",
          f"{fmt(vectors)} points x {fmt(sz['Qdrant payload (JSON)'])} bytes (prompt, answer, ids) x "
          f"{s.qdrant_replication} copies", f"CPU: {F.SIZES_SOURCE}")
    # -- archive ---------------------------------------------------------------------------------------
    per_turn = sz["archive bytes per turn (deflate)"]
    archive = per_day * per_turn
    p.add("archive bytes per day", archive, "bytes",
          f"{fmt(per_day)} turns x {fmt(per_turn)} bytes per archived turn (deflate); a year "
          f"{size(archive * 365)} (raw {fmt(sz['archive bytes per turn (raw: value + key + headers)'])} bytes a turn)",
          f"CPU: {F.SIZES_SOURCE}")
    return p
