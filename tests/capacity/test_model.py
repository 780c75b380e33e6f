"""The capacity model's arithmetic, line by line, and the records it is sized from."""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from capacity import figures as F
from capacity.model import CapacitySettings, plan, size
from capacity.records import lmsys_turns, measure_record_sizes
from capacity.settings import TrafficSettings, WorkloadSettings
from chatpipe.cli import app


def test_the_traffic_lines_multiply_out():
    p = plan(CapacitySettings(users=1_000_000, messages_per_user_day=4.0), traffic=TrafficSettings(peak_to_trough=3.0))
    assert p["messages per day"].value == 4_000_000
    assert p["mean rate"].value == pytest.approx(4_000_000 / 86_400)
    assert p["diurnal peak"].value == pytest.approx(4_000_000 / 86_400 * 1.5)  # 3:1 -> peak/mean 2r/(r+1)
    assert p["sizing peak (flash crowd at the diurnal peak)"].value == pytest.approx(4_000_000 / 86_400 * 3.0)


def test_gpus_come_from_the_gpu_figure():
    s = CapacitySettings(users=10_000_000, messages_per_user_day=3.7, utilization=0.5)
    p = plan(s, WorkloadSettings(answer_tokens=200))
    peak_tokens = 10_000_000 * 3.7 / 86_400 * 1.5 * 200
    assert p["inference GPUs at the diurnal peak"].value == math.ceil(peak_tokens / (480 * 0.5))
    assert "GPU" in p["inference GPUs at the diurnal peak"].source
    assert "random-init" in p["inference GPUs at the diurnal peak"].source
    hours = p["GPU-hours per day (autoscaled)"].value
    assert hours == pytest.approx(peak_tokens / 1.5 * 24 / (480 * 0.5))
    one_b = plan(CapacitySettings(users=10_000_000, gpu_shape="gpu-1b", utilization=0.5), WorkloadSettings(answer_tokens=200))
    assert one_b["inference GPUs at the diurnal peak"].value < p["inference GPUs at the diurnal peak"].value


def test_partitions_cover_the_workers_in_multiples_of_six():
    p = plan(CapacitySettings(users=50_000_000))
    gpus = p["inference GPUs in a flash crowd at the peak"].value
    parts = p["partitions of chat.inference.requests (partition intake)"].value
    assert parts >= gpus and parts % 6 == 0 and parts - gpus < 6
    streams = p["streams workers (2 cores each) at the sizing peak"].value
    assert p["partitions of the streams topics"].value >= streams
    assert p["partitions of the streams topics"].value % 6 == 0
    assert p["Kafka brokers"].value >= 3


def test_small_deployments_need_the_minimum():
    p = plan(CapacitySettings(users=100))
    assert p["inference GPUs at the diurnal peak"].value == 1
    assert p["partitions of the streams topics"].value == 6
    assert p["Kafka brokers"].value == 3  # the replication factor


def test_qdrant_follows_the_documented_formula():
    s = CapacitySettings(users=1_000_000, messages_per_user_day=2.0, memory_retention_days=10, qdrant_replication=1)
    p = plan(s)
    vectors = 1_000_000 * 2.0 * 10
    assert p["Qdrant RAM for the vectors"].value == pytest.approx(vectors * 384 * 4 * 1.5)
    assert p["Qdrant payload on disk"].value == pytest.approx(vectors * F.SIZES["Qdrant payload (JSON)"])
    assert p["Qdrant RAM for the vectors"].unit == "bytes"


def test_archive_bytes_per_day_use_the_measured_turn_size():
    p = plan(CapacitySettings(users=2_000_000, messages_per_user_day=3.0))
    assert p["archive bytes per day"].value == pytest.approx(6_000_000 * F.SIZES["archive bytes per turn (deflate)"])
    assert size(1536) == "1.5 KiB" and size(3 * 1024**4) == "3.0 TiB"


def test_every_line_shows_its_arithmetic_and_a_labelled_source():
    for line in plan(CapacitySettings(users=100_000_000)).lines:
        assert line.arithmetic and line.source
        text = line.render()
        assert line.name in text and "=" in text
    measured = [line for line in plan(CapacitySettings()).lines if "CPU:" in line.source or "GPU:" in line.source]
    assert len(measured) >= 8


def test_record_sizes_are_measured_with_the_codec_and_the_archive_deflate():
    answers = [f"Answer {i}: the river carved the valley over many thousands of years, slowly, as water does. "
               f"Number {i} is {'even' if i % 2 == 0 else 'odd'}." for i in range(80)]
    prompts = [f"Prompt {i}: explain how rivers shape valleys, with examples and a short story about it." for i in range(9)]
    turns = lmsys_turns(prompts, answers)
    assert all(len(a) // 4 >= 0.8 * 214.5 for _, a in turns)
    sizes = measure_record_sizes(prompts, answers)
    assert sizes["archive bytes per turn (deflate)"] < sizes["archive bytes per turn (raw: value + key + headers)"]
    assert sizes["ConversationTurn"] > sizes["Response"] > sizes["TokenChunk"] > 0
    assert sizes["InferenceRequest (4 recalled turns)"] > 4 * sizes["Response"]
    assert sizes["TokenChunks per answer"] == pytest.approx(sizes["answer tokens per turn"])


def test_the_command_prints_the_plan_and_a_simulated_day():
    runner = CliRunner()
    out = runner.invoke(app, ["capacity", "--users", "100000000"])
    assert out.exit_code == 0, out.output
    assert "inference GPUs at the diurnal peak" in out.output and "archive bytes per day" in out.output
    out = runner.invoke(app, ["capacity", "simulate", "--messages-per-day", "20000", "--hours", "2",
                              "--curve", "gpu-1b", "--step-minutes", "30"])
    assert out.exit_code == 0, out.output
    assert "GPU-hours" in out.output and "queue wait" in out.output and "replicas" in out.output
    out = runner.invoke(app, ["capacity", "simulate", "--lag-threshold", "-1"])
    assert out.exit_code != 0
