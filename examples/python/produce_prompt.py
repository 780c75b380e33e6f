#!/usr/bin/env python3
"""Send one prompt to chatpipe by producing to ``chat.prompts`` and stream the answer back.

A stand-alone example for application teams (docs/producing.md): it uses only fastavro and
confluent-kafka and the ``.avsc`` files of chatpipe's ``schemas/avro`` folder, no chatpipe code.
It

1. loads every PromptRequest and TokenChunk schema version and computes each one's CRC-64-AVRO
   fingerprint (the Avro spec's "single-object encoding" names the writer schema by it);
2. creates its reply topic if missing (or uses ``--reply-topic``) and starts reading it at its
   current end, *before* producing, so no chunk of the answer can be missed;
3. produces a PromptRequest v2 (``C3 01`` + 8-byte fingerprint + Avro body), keyed by the
   conversation id (utf-8) and partitioned by murmur2 like every chatpipe producer, whose
   ``reply_to``/``reply_partition`` name that reply address;
4. prints the answer's text as its TokenChunks arrive and, from the final chunk, the usage.

Exit codes: 0 answered; 2 the pipeline answered with an error chunk (its ``error_code`` and
``error`` are printed on stderr); 3 no final chunk within ``--timeout-s``; 1 bad arguments or
schemas.

Not here: retries, many prompts at once, or a long-running client (keep one consumer of the
reply topic for the life of your application instead of one per prompt).
"""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
import time
import uuid
from pathlib import Path

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from fastavro import parse_schema, schemaless_reader, schemaless_writer
from fastavro.schema import fingerprint, to_parsing_canonical_form

MARKER = b"\xc3\x01"  # Avro single-object encoding, format version 1
HEADER_LEN = len(MARKER) + 8
ATTEMPT_HEADER = "chatpipe-attempt"  # names one serving attempt: a retried request restarts its stream
DEFAULT_SCHEMA_DIR = Path(__file__).resolve().parents[2] / "schemas" / "avro"
EXIT_ERROR_CHUNK, EXIT_TIMEOUT = 2, 3


class Schemas:
    """Every version of one record (``<Name>.v<N>.avsc``), by fingerprint; the newest is the reader."""

    def __init__(self, schema_dir: Path, name: str) -> None:
        self.writers: dict[bytes, dict] = {}  # 8 fingerprint bytes as on the wire -> parsed schema
        versions: dict[int, tuple[bytes, dict]] = {}
        for path in schema_dir.glob(f"{name}.v*.avsc"):
            match = re.fullmatch(rf"{name}\.v(\d+)\.avsc", path.name)
            if not match:
                continue
            raw = json.loads(path.read_text())
            # fastavro's hex digest is the fingerprint's 8 bytes in little-endian order, as the
            # spec writes them after the marker (same bytes as Java's SchemaNormalization + encoder).
            fp = bytes.fromhex(fingerprint(to_parsing_canonical_form(raw), "CRC-64-AVRO"))
            parsed = parse_schema(raw)
            self.writers[fp] = parsed
            versions[int(match[1])] = (fp, parsed)
        if not versions:
            raise SystemExit(f"no {name}.v*.avsc in {schema_dir} (give --schema-dir)")
        self.version = max(versions)
        self.fingerprint, self.reader = versions[self.version]

    def encode(self, record: dict) -> bytes:
        buf = io.BytesIO()
        buf.write(MARKER + self.fingerprint)
        schemaless_writer(buf, self.reader, record)
        return buf.getvalue()

    def decode(self, data: bytes) -> dict:
        """The record in ``data`` as the newest version (Avro resolution fills added fields' defaults)."""
        if data[:2] != MARKER or len(data) < HEADER_LEN:
            raise ValueError("not Avro single-object encoding")
        writer = self.writers.get(data[2:HEADER_LEN])
        if writer is None:
            raise ValueError(f"unknown writer fingerprint {data[2:HEADER_LEN].hex()} (newer schemas?)")
        return schemaless_reader(io.BytesIO(data[HEADER_LEN:]), writer, self.reader)


def ensure_reply_topic(bootstrap: str, topic: str) -> None:
    """Create a one-partition reply topic with short retention; fine if it already exists."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1,
                                            config={"retention.ms": str(60 * 60 * 1000)})])
    try:
        futures[topic].result(30)
    except TimeoutError:
        raise SystemExit(f"error: no answer from the Kafka broker at {bootstrap} within 30 s") from None
    except KafkaException as exc:
        if exc.args[0].name() != "TOPIC_ALREADY_EXISTS":
            raise


def prompt_producer(bootstrap: str) -> Producer:
    """The producer of prompts: idempotent, and partitioning keys the way chatpipe does."""
    # The partitioner is part of the contract (docs/producing.md "Keys and partitions"): Kafka's murmur2 of
    # the key, as chatpipe's gateway and streams tier and every Java client compute it. librdkafka's default
    # (CRC32) would put your conversation on another partition than the gateway puts it.
    return Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "partitioner": "murmur2_random"})


def reply_reader(bootstrap: str, topic: str, partition: int, timeout_s: float) -> Consumer:
    """A consumer placed at the reply partition's current end (an explicit offset, not OFFSET_END,
    which would be resolved lazily and could land after a fast first chunk)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reply-{uuid.uuid4().hex}",
                         "enable.auto.commit": False, "fetch.wait.max.ms": 20})
    deadline = time.monotonic() + timeout_s
    while True:  # a topic created a moment ago may not be in every broker's metadata yet
        try:
            _, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=5)
            break
        except KafkaException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    consumer.assign([TopicPartition(topic, partition, high)])
    return consumer


def prompt_request(args: argparse.Namespace, reply_topic: str) -> dict:
    messages = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    for item in args.history:  # a client that keeps its own history sends it whole, oldest first
        role, _, content = item.partition(":")
        messages.append({"role": role, "content": content})
    messages.append({"role": args.role, "content": args.prompt})
    return {
        "request_id": uuid.uuid4().hex,
        "conversation_id": args.conversation_id,
        "user_id": args.user_id,
        "tenant": args.tenant,
        "created_at": int(time.time() * 1000),  # timestamp-millis: epoch milliseconds
        "model": args.model,
        "messages": messages,
        "sampling": {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": 1.0, "top_k": 0,
                     "seed": args.seed, "stop": []},
        "stream": True,
        "reply_to": reply_topic,  # the full topic name: no prefix is added to it
        "reply_partition": args.reply_partition,
        "priority": args.priority,
        "schema_version": 2,
    }


def stream_answer(consumer: Consumer, chunks: Schemas, request_id: str, timeout_s: float) -> dict | None:
    """Print the text of ``request_id``'s chunks as they come; the final chunk, or None on timeout.

    Other requests' chunks on a shared reply topic are skipped. If a worker died mid-answer, the
    request is served again under a new ``chatpipe-attempt``: the stream restarts from index 0.
    """
    deadline = time.monotonic() + timeout_s
    attempt: str | None = None
    next_index = 0
    while time.monotonic() < deadline:
        for msg in consumer.consume(100, 0.2):
            if msg.error() is not None:
                raise KafkaException(msg.error())
            chunk = chunks.decode(msg.value())
            if chunk["request_id"] != request_id:
                continue
            this_attempt = dict(msg.headers() or []).get(ATTEMPT_HEADER)
            if this_attempt != attempt:
                if chunk["index"] != 0:
                    continue  # the rest of an abandoned attempt
                if next_index:
                    print("\n[the request was served again; the answer restarts]", file=sys.stderr)
                attempt, next_index = this_attempt, 0
            if chunk["index"] != next_index:
                continue  # a duplicate chunk (chunks of one attempt arrive in order on one partition)
            next_index += 1
            sys.stdout.write(chunk["text"])
            sys.stdout.flush()
            if chunk["is_final"]:
                return chunk
    return None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # exit 1, not argparse's 2: 2 means "the pipeline answered with an error"
        self.print_usage(sys.stderr)
        self.exit(1, f"{self.prog}: error: {message}\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--bootstrap-servers", default="127.0.0.1:9092", help="Kafka host:port")
    p.add_argument("--topic-prefix", default="", help="the pipeline's CHATPIPE_TOPIC_PREFIX, e.g. 'prod.'")
    p.add_argument("--reply-topic", default=None,
                   help="full name of an existing reply topic to use; default: create <prefix>replies.<random>")
    p.add_argument("--reply-partition", type=int, default=0, help="partition of the reply topic to be answered on")
    p.add_argument("--conversation-id", default=None, help="continue a conversation; default: a new one")
    p.add_argument("--prompt", required=True, help="the new message")
    p.add_argument("--role", default="user", help="role of --prompt (the pipeline answers only 'user')")
    p.add_argument("--system", default=None, help="a system prompt (default: the pipeline's)")
    p.add_argument("--history", action="append", default=[], metavar="ROLE:TEXT",
                   help="earlier messages, oldest first, if you keep the history yourself (repeatable)")
    p.add_argument("--user-id", default="example-user")
    p.add_argument("--tenant", default="example-tenant")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--priority", choices=("INTERACTIVE", "BATCH"), default="INTERACTIVE")
    p.add_argument("--timeout-s", type=float, default=120.0, help="how long to wait for the final chunk")
    p.add_argument("--schema-dir", type=Path, default=DEFAULT_SCHEMA_DIR, help="chatpipe's schemas/avro folder")
    args = p.parse_args(argv)
    args.conversation_id = args.conversation_id or uuid.uuid4().hex
    for item in args.history:
        if ":" not in item:
            p.error(f"--history {item!r}: expected ROLE:TEXT, e.g. user:hello")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = Schemas(args.schema_dir, "PromptRequest")
    chunks = Schemas(args.schema_dir, "TokenChunk")
    reply_topic = args.reply_topic or f"{args.topic_prefix}replies.{uuid.uuid4().hex[:12]}"
    if args.reply_topic is None:
        ensure_reply_topic(args.bootstrap_servers, reply_topic)
    consumer = reply_reader(args.bootstrap_servers, reply_topic, args.reply_partition, args.timeout_s)
    try:
        request = prompt_request(args, reply_topic)
        producer = prompt_producer(args.bootstrap_servers)
        producer.produce(f"{args.topic_prefix}chat.prompts", key=args.conversation_id.encode(),
                         value=prompts.encode(request))
        if producer.flush(30) != 0:
            print("error: the prompt was not delivered to Kafka within 30 s", file=sys.stderr)
            return EXIT_TIMEOUT
        print(f"request {request['request_id']} conversation {args.conversation_id} -> "
              f"reply {reply_topic}[{args.reply_partition}]", file=sys.stderr)
        final = stream_answer(consumer, chunks, request["request_id"], args.timeout_s)
    finally:
        consumer.close()
    print()
    if final is None:
        print(f"error: no final chunk within {args.timeout_s:.0f} s", file=sys.stderr)
        return EXIT_TIMEOUT
    if final["error_code"] is not None:
        print(f"error: {final['error_code']}: {final['error']}", file=sys.stderr)
        return EXIT_ERROR_CHUNK
    print(f"usage: prompt_tokens={final['tokens_in']} completion_tokens={final['tokens_out']} "
          f"finish_reason={final['finish_reason']}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KafkaException as exc:  # broker unreachable, topic missing, ...: one line, not a traceback
        print(f"error: kafka: {exc}", file=sys.stderr)
        sys.exit(1)
