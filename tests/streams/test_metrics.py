"""The streams worker's ``/metrics`` (streams/metrics.py) on the real ``chatpipe streams`` process: batch
sizes, recall and embedding latency, assembled prompt tokens, records by agent and outcome, dead
letters by reason, the conversations held, and its consumer group's lag in records and seconds.

The test plays the inference worker (answers each request itself, as tests/streams/test_pipeline.py)."""

from __future__ import annotations

import time
import urllib.request
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from chatpipe.testing.kafka import RecordWriter
from chatpipe.testing.ports import free_port
from chatpipe.testing.streams import StreamsWorker, Tap
from tests.streams.stand_in import Conversation
from transport.settings import KafkaSettings

pytestmark = pytest.mark.integration


def _scrape(port: int) -> dict[str, list[tuple[dict, float]]]:
    body = urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
        f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def _value(samples, name: str, **labels) -> float:
    return sum(v for got, v in samples.get(name, []) if all(got.get(k) == w for k, w in labels.items()))


def test_metrics_count_what_each_agent_did_and_the_groups_lag(kafka_stack, tmp_path):
    """Guards against a streams tier nobody can watch: every figure must move with the work done (3
    prompts served and recorded, 1 undecodable), the table size must be the conversations it holds,
    and the lag of its Faust group must be measured (records and seconds), 0 once all is done."""
    from transport.admin import TopicAdmin

    kafka = KafkaSettings(bootstrap_servers=kafka_stack.bootstrap_servers, topic_prefix=f"m{uuid.uuid4().hex[:8]}.")
    TopicAdmin(kafka).apply()
    port = free_port()
    worker = StreamsWorker(kafka, tmp_path, metrics_port=port, lag_interval_s=1)
    requests, turns = Tap(kafka, "chat.inference.requests"), Tap(kafka, "chat.turns")
    worker.start()
    try:
        with RecordWriter(kafka) as producer:
            producer.send_bytes(kafka.topic("chat.prompts"), b"not a PromptRequest", key="conv-bad")
            conv = Conversation(producer, requests, turns, "acme", "u-metrics", "conv-metrics")
            for i in range(3):
                conv.turn(f"Question number {i} about metrics?", f"Answer {i}.")
        deadline = time.monotonic() + 60
        while True:
            samples = _scrape(port)
            group, prompts = f"{kafka.topic_prefix}chatpipe-streams", kafka.topic("chat.prompts")
            lag = _value(samples, "chatpipe_consumer_lag_records", group=group, topic=prompts)
            done = (_value(samples, "chatpipe_streams_records_total", agent="record", outcome="ok") == 3
                    and _value(samples, "chatpipe_streams_records_total", agent="intake", outcome="dead_letter") == 1
                    and ("chatpipe_consumer_lag_records" in samples and lag == 0))
            if done or time.monotonic() > deadline:
                break
            time.sleep(1)
    finally:
        requests.close()
        turns.close()
        assert worker.stop() == 0, worker.tail()

    assert _value(samples, "chatpipe_streams_records_total", agent="intake", outcome="ok") == 3
    assert _value(samples, "chatpipe_streams_records_total", agent="intake", outcome="dead_letter") == 1
    assert _value(samples, "chatpipe_streams_records_total", agent="intake", outcome="refused") == 0
    assert _value(samples, "chatpipe_streams_records_total", agent="record", outcome="ok") == 3
    assert _value(samples, "chatpipe_streams_dead_letters_total", component="streams.intake") == 1
    assert _value(samples, "chatpipe_streams_conversations") == 1
    assert _value(samples, "chatpipe_streams_intake_batch_size_sum") == 4  # the garbage one was in a batch too
    assert _value(samples, "chatpipe_streams_assembled_prompt_tokens_count") == 3
    assert _value(samples, "chatpipe_streams_assembled_prompt_tokens_sum") > 3 * 10
    for name in ("chatpipe_streams_recall_seconds_count", "chatpipe_streams_embed_seconds_count"):
        assert _value(samples, name) >= 1, name
    assert "chatpipe_streams_retries_total" in samples
    topics = {labels["topic"] for labels, _ in samples["chatpipe_consumer_lag_records"]
              if labels["group"] == f"{kafka.topic_prefix}chatpipe-streams"}
    assert {kafka.topic(t) for t in ("chat.prompts", "chat.responses", "chat.turns", "chat.deletions")} <= topics
    assert _value(samples, "chatpipe_consumer_lag_records", topic=kafka.topic("chat.prompts")) == 0
    ages = [v for labels, v in samples["chatpipe_consumer_lag_seconds"]]
    assert ages and all(v >= 0 for v in ages), ages  # measured (-1 would be "not known")
