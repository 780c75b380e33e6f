"""The same turns read from a real Kafka topic and from the archive give identical datasets."""

from __future__ import annotations

import pytest

from chatpipe.testing.synthetic_log import generate, to_messages, writer_version
from spark_jobs.settings import FinetuneSettings
from transport.archive import ArchivedMessage, write_messages

pytestmark = [pytest.mark.spark, pytest.mark.integration]


def _consume_all(kafka_settings, topic: str, expected: int) -> list[ArchivedMessage]:
    from confluent_kafka import Consumer

    consumer = Consumer({**kafka_settings.client_config(), "group.id": f"archive-{topic}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    consumer.subscribe([topic])
    out = []
    try:
        for _ in range(600):
            if len(out) >= expected:
                break
            for m in consumer.consume(500, timeout=0.5):
                if m.error():
                    raise RuntimeError(m.error())
                out.append(ArchivedMessage(m.topic(), m.partition(), m.offset(), m.timestamp()[1], m.key(),
                                           m.value(), tuple(m.headers() or ())))
    finally:
        consumer.close()
    assert len(out) == expected, f"consumed {len(out)} of {expected} from {topic}"
    return out


def test_kafka_and_archive_sources_give_identical_datasets(spark, kafka_settings, topic_factory, tmp_path):
    """Catches a source that reads different records, offsets or timestamps than the other (bounded
    Kafka batch read vs the archive layout), which would make datasets depend on where they came from."""
    from chatpipe.testing.kafka import RecordWriter
    from spark_jobs.finetune_dataset import run

    turns_topic, feedback_topic = topic_factory(partitions=3), topic_factory(partitions=3)
    log = generate(n_turns=150, seed=5)
    msgs = to_messages(log, turns_topic, feedback_topic)
    with RecordWriter(kafka_settings) as producer:
        for m in msgs:
            producer.send_bytes(m.topic, m.value, key=m.key, partition=m.partition)
        producer.flush()
    n_turns = sum(m.topic == turns_topic for m in msgs)
    archived = _consume_all(kafka_settings, turns_topic, n_turns) + \
        _consume_all(kafka_settings, feedback_topic, len(msgs) - n_turns)
    write_messages(tmp_path / "archive", archived)

    kafka = kafka_settings.model_copy(update={"topic_prefix": ""})  # topic_factory names are full names
    eval_file = tmp_path / "eval.txt"
    eval_file.write_text("\n".join(log.eval_lines))
    base = dict(turns_topic=turns_topic, feedback_topic=feedback_topic, eval_files=(eval_file,),
                validation_fraction=0.3)
    from_kafka = run(spark, FinetuneSettings(source="kafka", out=tmp_path / "k", **base), kafka)
    from_archive = run(spark, FinetuneSettings(source="archive", archive_dir=tmp_path / "archive",
                                               out=tmp_path / "a", **base), kafka)
    assert from_kafka.card["input"]["turns_read"] == n_turns
    same = lambda card: {**card, "settings": None, "input": {**card["input"], "source": None}}
    assert same(from_kafka.card) == same(from_archive.card)
    for name in ("sft/train.jsonl", "sft/validation.jsonl", "preference/train.jsonl", "preference/validation.jsonl"):
        assert (from_kafka.out / name).read_bytes() == (from_archive.out / name).read_bytes(), name
    import pandas as pd

    k = pd.read_parquet(from_kafka.out / "parquet" / "dropped")
    a = pd.read_parquet(from_archive.out / "parquet" / "dropped")
    assert k.equals(a)

    # Lineage: both sources give every SFT and pair row the same trace and request ids, the turns' own.
    def lineage(out, table: str, cols: list[str]) -> list[dict]:
        rows = pd.read_parquet(out / "parquet" / table)[cols].to_dict("records")
        return [{c: list(v) if c.endswith("_ids") else (None if pd.isna(v) else v) for c, v in r.items()} for r in rows]
    pair_cols = ["pair_id", "chosen_trace_id", "rejected_trace_id", "request_ids", "trace_ids"]
    for table, cols in (("sft", ["event_id", "request_id", "trace_id", "request_ids", "trace_ids"]),
                        ("preference", pair_cols)):
        assert lineage(from_kafka.out, table, cols) == lineage(from_archive.out, table, cols), table
    by_event = {t.event_id: t for t in log.turns}

    def written_trace(event_id: str) -> str | None:  # v1/v2 turns carry none
        t = by_event[event_id]
        return t.trace_id if writer_version(t, event_id in log.v1_event_ids) >= 3 else None
    sft = lineage(from_kafka.out, "sft", ["event_id", "trace_id"])
    expected = [written_trace(r["event_id"]) for r in sft]
    assert [r["trace_id"] for r in sft] == expected and any(expected) and None in expected
