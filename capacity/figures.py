"""Every measured figure the simulation and the capacity model use, with where and when it was measured.

Labels: **CPU** = this project's 2-core AMD EPYC VM (24 GiB, no GPU), the machine of every bench in
docs/benchmarks.md; **GPU** = one lent NVIDIA H200 of an earlier session (docs/benchmarks.md "GPU": torch 2.11 + CUDA 13.0,
bf16, **random-init** Llama shapes: no weights could be fetched there, so the speed is real and the
text is noise). Public figures (not ours) are in ``capacity.settings`` and docs/deploy.md with sources.
"""

from __future__ import annotations

from dataclasses import dataclass

from capacity.simulate import Curve


@dataclass(frozen=True)
class Figure:
    value: float
    unit: str
    label: str  # "CPU" | "GPU" | "docs"
    source: str  # file + figure (+ run)

    def cite(self) -> str:
        return f"{self.label}: {self.source}"


# -- inference worker throughput curves (output tokens/s of one worker with k requests running) ------

# docs/benchmarks.md "GPU" table: Llama-3.1-8B shape, engine 480 tok/s on 64 requests in batches of 32 (prompts
# median 256, outputs median 128); batch-1 decode 25.6 ms/token -> 39.1 tok/s. Two points; linear between.
GPU_8B = Curve(((1, 1000 / 25.6), (32, 480.0)), label="GPU H200, Llama-3.1-8B shape (README 'GPU')")
GPU_1B = Curve(((1, 1000 / 19.3), (32, 726.0)), label="GPU H200, Llama-3.2-1B shape (README 'GPU')")
GPU_SOURCE = ("README.md 'GPU' table (bench/engine.py --device cuda --shapes llama-1b,llama-8b, 2026-11-30): "
              "engine tok/s at batch 32 and batch-1 decode ms/token; random-init weights")

# bench/capacity.py: one `chatpipe inference` process, SmolLM2-135M-Instruct, float32, 1 torch thread,
# engine max batch 4, requests straight on chat.inference.requests (closed loop, medians of 3 rounds spread
# over the run). CPU_RUN names the run (the record sizes below come from it too).
CPU_RUN = "bench/capacity.py full run of 2026-12-02 01:46 UTC, quiet machine (docs/deploy.md 'Validation')"
CPU = Curve(((1, 13.8), (2, 16.4), (3, 19.3), (4, 28.7)),
            label="CPU SmolLM2-135M, 1 thread, max batch 4 (bench/capacity.py)")

CURVES = {"gpu-8b": GPU_8B, "gpu-1b": GPU_1B, "cpu": CPU}

WORKER_START_S = Figure(13.7, "s", "CPU", f"{CPU_RUN}: `chatpipe inference` process start to SERVING, model "
                        "load included (chatpipe/testing/worker.py start_worker; 8-17 s over the runs)")
JOIN_S = Figure(2.9, "s", "CPU", f"{CPU_RUN}: the second worker's SERVING to its first answer (the group's "
                "rebalance; 2.4-9 s over the runs)")

# -- streams tier (2 cores per worker) -----------------------------------------------------------------
STREAMS_INTAKE = Figure(389.5, "prompts/s per worker", "CPU",
                        "README 'bench/intake.py', full, quiet, bf16 embedding model, 14:47: batched intake "
                        "(context assembly with memory recall)")
STREAMS_RECORD = Figure(246.1, "turns/s per worker", "CPU",
                        "README 'bench/intake.py' memory figures, same 14:47 run (bench/memory.py): embed + "
                        "upsert of answered turns")

# -- Kafka ------------------------------------------------------------------------------------------------
# bench/capacity.py step 5: one broker (KRaft, Kafka 4.4.0) on the same 2 shared cores as its client;
# medians of 8 runs of 2026-12-02 (produced 0.98-2.90, read 0.15-1.05: least on a quiet machine).
BROKER_PRODUCE_CPU = Figure(2.20, "broker CPU-s per million records produced", "CPU",
                            "bench/capacity.py step 5, median of 8 runs (0.98-2.90): 122-byte TokenChunks, lz4, "
                            "linger 5 ms, acks=all")
BROKER_CONSUME_CPU = Figure(0.17, "broker CPU-s per million records read", "CPU",
                            "bench/capacity.py step 5, median of 8 runs (0.15-1.05): one consumer")
CLIENT_CONSUME = Figure(30_000, "records/s per consumer", "CPU",
                        "README 'bench/kafka_io.py': record path end to end, consume+decode 30-54k msg/s (low end)")

# -- record sizes (capacity/records.py on this run's answers; bytes) -------------------------------------
SIZES = {  # bytes; 48 turns of 70.9 prompt / 238.6 answer tokens built from the run's answers
    "PromptRequest": 508.2,
    "InferenceRequest (prompt only)": 555.2,
    "InferenceRequest (4 recalled turns)": 6239.0,
    "Response": 1200.8,
    "ConversationTurn": 1607.0,
    "TokenChunk": 121.0,
    "Qdrant payload (JSON)": 1600.8,
    "TokenChunks per answer": 238.6,
    "answer tokens per turn": 238.6,
    "Kafka headers per record (traceparent)": 66.0,
    "archive bytes per turn (deflate)": 234.7,
    "archive bytes per turn (raw: value + key + headers)": 1709.0,
}
SIZES_SOURCE = f"{CPU_RUN} step 4 (capacity/records.py: the codec, transport/archive.py's deflate)"

# -- Qdrant (docs) ----------------------------------------------------------------------------------------
EMBEDDING_DIM = Figure(384, "dimensions", "docs", "all-MiniLM-L6-v2 (streams/embeddings.py)")
QDRANT_OVERHEAD = Figure(1.5, "x", "docs", "Qdrant capacity planning: memory_size = number_of_vectors x "
                         "vector_dimension x 4 bytes x 1.5 (qdrant.tech/documentation/cloud/capacity-sizing)")
