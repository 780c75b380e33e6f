"""One partitioner everywhere (docs/producing.md "Keys and partitions"): for the same key, every
producer of the project and every client we document picks the same partition.

Compared for ~2,000 keys (conversation ids the gateway accepts, UUIDs, and keys only a direct
producer can send: unicode, NFC vs NFD, control characters, one byte):

- ``transport.partitioning.partition_of`` (the streams tier's rule) and aiokafka's
  ``DefaultPartitioner``, the partitioner Faust hands its aiokafka producer (checked on a real
  ``faust.App``: nothing overrides it);
- the Java client, in real Java: ``Utils.toPositive(Utils.murmur2(key)) % n`` and
  ``BuiltInPartitioner.partitionForKey`` of the kafka-clients jar the project already has,
  compiled at test time with ``javac`` (``tests/java_partitions.py``; cached for the session);
- with the session's broker (``integration``): the partition each record actually landed on,
  read back from a 6-partition topic, for the gateway's producer (``AckedWriter``, the prompt
  send of ``GatewayService.submit``), the worker's producer (``AckedWriter`` too, through
  ``inference.worker.replies.send_response``), Faust's producer settings (aiokafka), the Python
  example's ``prompt_producer`` and a Java ``KafkaProducer`` configured like examples/java.
"""

from __future__ import annotations

import asyncio
import importlib.util
import random
import re
import string
import sys
import time
import uuid
from pathlib import Path

import pytest

from schemas.topics import PROMPTS, RESPONSES, spec
from transport.partitioning import LIBRDKAFKA_PARTITIONER, partition_of

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "python" / "produce_prompt.py"
PARTITION_COUNTS = (1, 2, 3, 6, 7, 12, 50)
TOPIC_PARTITIONS = spec(PROMPTS).partitions  # 6: the prompts' (and every conversation topic's) count
GATEWAY_ID = re.compile(r"[A-Za-z0-9._:@-]{1,128}")  # schemas.requests.CONVERSATION_ID


def agreement_keys(n: int = 2000) -> list[str]:
    """Fixed edge cases, then seeded random gateway ids, UUIDs and unicode keys; no duplicates."""
    rng = random.Random(24)
    alphabet = string.ascii_letters + string.digits + "._:@-"
    keys = dict.fromkeys(["a", "0", "-", "@", ".", "x" * 128, "z" * 127 + "-", "conversation-1", "user@example.com:42",
                          # Only a direct producer can send these (the gateway takes 1-128 of A-Z a-z 0-9 . _ : @ -);
                          # "" is an empty key, not a null one: murmur2 of no bytes, not a random partition.
                          "", " ", "\t", "\n", "\x00", "a b", "Gespräch-ü", "会话-1", "🙂", "🙂" * 64, "\u00e9", "e\u0301",
                          "\u202e-rtl", "\ufeffbom", "Ω" * 200])
    while len(keys) < n * 0.75:
        size = rng.choice((1, 2, 3, 4, 8, 16, 32, 36, 64, 128, rng.randint(1, 128)))
        keys["".join(rng.choice(alphabet) for _ in range(size))] = None
    while len(keys) < n * 0.85:
        keys[str(uuid.UUID(int=rng.getrandbits(128)))] = None
    ranges = ((0x20, 0x7E), (0xA0, 0x24F), (0x300, 0x36F), (0x400, 0x4FF), (0x3040, 0x30FF), (0x4E00, 0x9FFF),
              (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF), (0x10000, 0x10FFF))
    while len(keys) < n:
        keys["".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.randint(1, 40)))] = None
    return list(keys)


KEYS = agreement_keys()


def test_the_keys_cover_gateway_ids_and_direct_producers_only_keys():
    gateway = [k for k in KEYS if GATEWAY_ID.fullmatch(k)]
    assert len(KEYS) == 2000 and len(gateway) >= 1400
    assert any(len(k.encode()) > len(k) for k in KEYS), "no multi-byte utf-8 key"
    assert {1, 128} <= {len(k) for k in gateway}


@pytest.mark.parametrize("partitions", PARTITION_COUNTS)
def test_partition_of_is_aiokafkas_default_partitioner(partitions):
    from aiokafka.partitioner import DefaultPartitioner

    every = list(range(partitions))
    chosen = DefaultPartitioner()
    for key in KEYS:
        assert partition_of(key, partitions) == partition_of(key.encode(), partitions) \
            == chosen(key.encode(), every, every), key


def test_partition_of_known_values():
    """Kafka's own test vectors of ``Utils.murmur2`` (UtilsTest.testMurmur2), seen through toPositive."""
    vectors = {"21": -973932308, "foobar": -790332482, "a-little-bit-long-string": -985981536,
               "a-little-bit-longer-string": -1486304829, "lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
               "abc": 479470107}
    for key, hashed in vectors.items():
        assert partition_of(key, 2**31 - 1) == (hashed & 0x7FFFFFFF) % (2**31 - 1), key
    with pytest.raises(ValueError, match="at least one partition"):
        partition_of("a", 0)


def test_faust_hands_aiokafka_the_default_partitioner():
    """The streams tier's producer: Faust passes ``producer_partitioner`` (unset in streams/app.py) or
    aiokafka's DefaultPartitioner to its AIOKafkaProducer; a custom one here would split the tiers."""
    import faust
    from aiokafka.partitioner import DefaultPartitioner

    app = faust.App(f"partitioner-{uuid.uuid4().hex[:6]}", broker="kafka://127.0.0.1:1", autodiscover=False)
    producer = app.producer  # built, not started: nothing connects
    assert isinstance(producer.partitioner, DefaultPartitioner)
    assert isinstance(producer._settings_default()["partitioner"], DefaultPartitioner)
    assert "producer_partitioner" not in (REPO / "streams" / "app.py").read_text()


# -- the Java client, in Java -----------------------------------------------------------------------

def test_the_java_clients_partitioner_agrees(java_partitions):
    """Kafka's ``Utils.murmur2`` + ``toPositive`` and the producer's ``BuiltInPartitioner.partitionForKey``,
    in the JVM, against partition_of for every key and partition count."""
    lines = java_partitions(KEYS, PARTITION_COUNTS).splitlines()
    assert len(lines) == len(KEYS) * len(PARTITION_COUNTS)
    disagree = []
    for line in lines:
        _, n, i, utils, builtin = line.split()
        ours = partition_of(KEYS[int(i)], int(n))
        if not int(utils) == int(builtin) == ours:
            disagree.append(f"{KEYS[int(i)]!r} n={n}: java {utils}/{builtin}, ours {ours}")
    assert not disagree, f"{len(disagree)} disagreements, e.g. {disagree[:5]}"


# -- real round trips through the broker -----------------------------------------------------------


def landed_partitions(kafka, topic: str, expected: int, timeout_s: float = 60) -> dict[str, int]:
    """key (utf-8 text) -> the partition its record is on, reading ``topic`` from the start."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    consumer = Consumer({**kafka.client_config(), "group.id": f"read-{uuid.uuid4().hex[:8]}",
                         "enable.auto.commit": False})
    try:
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(TOPIC_PARTITIONS)])
        seen: dict[str, int] = {}
        deadline = time.monotonic() + timeout_s
        while len(seen) < expected and time.monotonic() < deadline:
            for msg in consumer.consume(1000, timeout=0.5):
                assert msg.error() is None, msg.error()
                seen[msg.key().decode()] = msg.partition()
        return seen
    finally:
        consumer.close()


def prompt_for(conversation_id: str):
    from schemas.records import ChatMessage, PromptRequest

    return PromptRequest(conversation_id=conversation_id, user_id="u", tenant="t", model="m",
                         messages=[ChatMessage("user", "hi")])


def assert_all_agree(where: str, landed: dict[str, int]) -> None:
    assert len(landed) == len(KEYS), f"{where}: {len(landed)} of {len(KEYS)} records read back"
    wrong = [f"{k!r}: on {p}, partition_of {partition_of(k, TOPIC_PARTITIONS)}" for k, p in landed.items()
             if p != partition_of(k, TOPIC_PARTITIONS)]
    assert not wrong, f"{where}: {len(wrong)} keys elsewhere, e.g. {wrong[:5]}"


@pytest.fixture
def own_prefix(kafka_settings, topic_admin):
    """KafkaSettings under a prefix of its own, whose ``chat.prompts`` and ``chat.responses`` are new."""
    kafka = kafka_settings.model_copy(update={"topic_prefix": f"{kafka_settings.topic_prefix}part{uuid.uuid4().hex[:6]}."})
    for name in (PROMPTS, RESPONSES):
        topic_admin.create_topic(kafka.topic(name), TOPIC_PARTITIONS, None)
    return kafka


@pytest.mark.integration
async def test_gateway_and_worker_producers_land_each_key_on_its_partition(own_prefix):
    """The gateway's send of a prompt and the worker's send of a Response, each with the service's own
    AckedWriter settings: records read back from the broker are where partition_of says."""
    from inference.worker.replies import send_response
    from inference.worker.settings import WorkerSettings
    from schemas.records import FinishReason, Response
    from transport.acked_writer import AckedWriter

    kafka = own_prefix
    gateway = AckedWriter(kafka, linger_ms=1.0)  # GatewayService.start
    worker = AckedWriter(kafka, linger_ms=WorkerSettings().chunk_linger_ms)  # InferenceWorker
    try:
        acks = []
        for key in KEYS:
            prompt = prompt_for(key)
            acks.append(gateway.send(kafka.topic(PROMPTS), prompt, key=key))  # as GatewayService.submit
            response = Response(request_id=prompt.request_id, conversation_id=key, user_id="u", tenant="t", text="x",
                                model="m", worker_id="w", tokens_in=1, tokens_out=1, queue_ms=0.0, ttft_ms=0.0,
                                total_ms=0.0, finish_reason=FinishReason.STOP, created_at=prompt.created_at)
            acks.append(send_response(worker, response, attempt="a1", parent_trace=None))
        await asyncio.gather(*acks)
    finally:
        await asyncio.to_thread(gateway.close, 30)
        await asyncio.to_thread(worker.close, 30)
    assert_all_agree("gateway (AckedWriter)", await asyncio.to_thread(landed_partitions, kafka,
                                                                        kafka.topic(PROMPTS), len(KEYS)))
    assert_all_agree("worker (AckedWriter, send_response)",
                     await asyncio.to_thread(landed_partitions, kafka, kafka.topic(RESPONSES), len(KEYS)))


@pytest.mark.integration
def test_acked_writer_keeps_murmur2_whatever_extra_config_says(kafka_settings, topic_factory):
    """A caller's extra_config cannot switch the services' producer back to librdkafka's default; a raw
    librdkafka producer without the property shows what the read-back check catches (CRC32)."""
    from confluent_kafka import Producer

    from transport.acked_writer import AckedWriter

    keys = KEYS[:300]
    ours, plain = topic_factory(partitions=TOPIC_PARTITIONS), topic_factory(partitions=TOPIC_PARTITIONS)

    async def send_all() -> None:
        producer = AckedWriter(kafka_settings, linger_ms=5, extra_config={"partitioner": "consistent_random"})
        try:
            await asyncio.gather(*[producer.send(ours, prompt_for(k), key=k) for k in keys])
        finally:
            await asyncio.to_thread(producer.close, 30)

    asyncio.run(send_all())
    raw = Producer({**kafka_settings.client_config(), "linger.ms": 5})
    for key in keys:
        raw.produce(plain, key=key.encode(), value=b"x")
    assert raw.flush(30) == 0
    landed = landed_partitions(kafka_settings, ours, len(keys))
    assert len(landed) == len(keys)
    assert all(p == partition_of(k, TOPIC_PARTITIONS) for k, p in landed.items())
    elsewhere = [k for k, p in landed_partitions(kafka_settings, plain, len(keys)).items()
                 if p != partition_of(k, TOPIC_PARTITIONS)]
    assert len(elsewhere) > len(keys) // 2, "librdkafka's default partitioner agreed: is the check blind?"
    assert LIBRDKAFKA_PARTITIONER == "murmur2_random"


@pytest.mark.integration
async def test_faust_producer_lands_each_key_on_its_partition(kafka_settings, topic_factory):
    """aiokafka with the partitioner Faust gives it (the streams tier's changelog and turn writes)."""
    import faust
    from aiokafka import AIOKafkaProducer

    topic = topic_factory(partitions=TOPIC_PARTITIONS)
    app = faust.App(f"partitioner-{uuid.uuid4().hex[:6]}", broker="kafka://127.0.0.1:1", autodiscover=False)
    producer = AIOKafkaProducer(bootstrap_servers=kafka_settings.bootstrap_servers, enable_idempotence=True,
                                partitioner=app.producer._settings_default()["partitioner"])
    await producer.start()
    try:
        await asyncio.gather(*[await producer.send(topic, b"x", key=key.encode()) for key in KEYS])
    finally:
        await producer.stop()
    assert_all_agree("faust (aiokafka)", await asyncio.to_thread(landed_partitions, kafka_settings, topic, len(KEYS)))


def load_example():
    spec_ = importlib.util.spec_from_file_location("produce_prompt_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec_)
    sys.modules[spec_.name] = module
    spec_.loader.exec_module(module)
    return module


@pytest.mark.integration
def test_python_example_producer_lands_each_key_on_its_partition(kafka_settings, topic_factory):
    """examples/python/produce_prompt.py's own producer, keyed as its main() keys a prompt."""
    topic = topic_factory(partitions=TOPIC_PARTITIONS)
    producer = load_example().prompt_producer(kafka_settings.bootstrap_servers)
    for key in KEYS:
        producer.produce(topic, key=key.encode(), value=b"x")
        producer.poll(0)
    assert producer.flush(30) == 0
    assert_all_agree("examples/python", landed_partitions(kafka_settings, topic, len(KEYS)))


@pytest.mark.integration
def test_java_producer_lands_each_key_on_its_partition(kafka_settings, topic_factory, java_partitions):
    """A KafkaProducer configured like examples/java (String key = the conversation id, default
    partitioner): the partition of each acknowledged record, and those read back, are partition_of's."""
    topic = topic_factory(partitions=TOPIC_PARTITIONS)
    out = java_partitions(KEYS, (TOPIC_PARTITIONS,), kafka_settings.bootstrap_servers, topic)
    acknowledged = {KEYS[int(i)]: int(p) for _, i, p in (line.split() for line in out.splitlines()
                                                         if line.startswith("sent "))}
    assert_all_agree("examples/java (acknowledged)", acknowledged)
    assert_all_agree("examples/java (read back)", landed_partitions(kafka_settings, topic, len(KEYS)))
