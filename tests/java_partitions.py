"""The Java client's partitioner, run in the JVM: a tiny program compiled at test time with ``javac``
against the kafka-clients jar ``examples/java`` builds with (``~/.m2``, else the broker's), for tests
that must place or check keys the way a Java application would (``java_partitions`` fixture, session
scope, registered in tests/conftest.py).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

JAVA_SOURCE = r"""
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.HexFormat;
import java.util.List;
import java.util.Properties;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerConfig;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.clients.producer.RecordMetadata;
import org.apache.kafka.clients.producer.internals.BuiltInPartitioner;
import org.apache.kafka.common.serialization.ByteArraySerializer;
import org.apache.kafka.common.serialization.StringSerializer;
import org.apache.kafka.common.utils.Utils;

/** args: KEYS_FILE (hex of each key's utf-8 bytes, one a line) PARTITION_COUNTS (1,2,...) [BOOTSTRAP TOPIC].
 *  Prints "hash N I UTILS BUILTIN" per count and key; with a broker also "sent I PARTITION" for each
 *  key produced by a KafkaProducer configured like examples/java (String keys, default partitioner). */
public class Partitions {
    public static void main(String[] args) throws Exception {
        HexFormat hex = HexFormat.of();
        List<String> lines = Files.readAllLines(Path.of(args[0]));
        StringBuilder out = new StringBuilder();
        for (String count : args[1].split(",")) {
            int n = Integer.parseInt(count);
            for (int i = 0; i < lines.size(); i++) {
                byte[] key = hex.parseHex(lines.get(i));
                out.append("hash ").append(n).append(' ').append(i).append(' ')
                   .append(Utils.toPositive(Utils.murmur2(key)) % n).append(' ')
                   .append(BuiltInPartitioner.partitionForKey(key, n)).append('\n');
            }
        }
        if (args.length > 2) {
            Properties p = new Properties();
            p.put(ProducerConfig.BOOTSTRAP_SERVERS_CONFIG, args[2]);
            p.put(ProducerConfig.ENABLE_IDEMPOTENCE_CONFIG, "true");
            try (KafkaProducer<String, byte[]> producer =
                         new KafkaProducer<>(p, new StringSerializer(), new ByteArraySerializer())) {
                List<java.util.concurrent.Future<RecordMetadata>> sent = new java.util.ArrayList<>();
                for (String line : lines) {
                    String key = new String(hex.parseHex(line), StandardCharsets.UTF_8);
                    sent.add(producer.send(new ProducerRecord<>(args[3], key, new byte[] {1})));
                }
                for (int i = 0; i < sent.size(); i++) {
                    out.append("sent ").append(i).append(' ').append(sent.get(i).get().partition()).append('\n');
                }
            }
        }
        System.out.print(out);
    }
}
"""


def kafka_clients_classpath() -> str:
    """The kafka-clients jar examples/java builds against (from ~/.m2), else the broker's, with slf4j-api."""
    from infra.local_kafka import ensure_jars, kafka_version
    from infra.settings import StackSettings

    version = re.search(r"<kafka.version>([^<]+)</kafka.version>", (REPO / "examples/java/pom.xml").read_text())[1]
    m2 = Path.home() / ".m2" / "repository" / "org" / "apache" / "kafka" / "kafka-clients" / version
    lib = ensure_jars(StackSettings())
    clients = m2 / f"kafka-clients-{version}.jar"
    if not clients.exists():
        assert version == kafka_version(), f"examples/java uses kafka-clients {version}, not in ~/.m2"
        clients = lib / f"kafka-clients-{version}.jar"
    slf4j = sorted(lib.glob("slf4j-api-*.jar"))
    return ":".join(str(p) for p in (clients, *slf4j))


@pytest.fixture(scope="session")
def java_partitions(tmp_path_factory):
    """``run(keys, counts, bootstrap=None, topic=None) -> stdout`` of the compiled Java program."""
    javac, java = shutil.which("javac"), shutil.which("java")
    assert javac and java, "a JDK is needed: the project's broker is Java and this test compiles against kafka-clients"
    classes = tmp_path_factory.mktemp("java-partitions")
    classpath = kafka_clients_classpath()
    (classes / "Partitions.java").write_text(JAVA_SOURCE)
    subprocess.run([javac, "-cp", classpath, "-d", str(classes), str(classes / "Partitions.java")],
                   check=True, capture_output=True, text=True, timeout=120)

    def run(keys: list[str], counts: tuple[int, ...], bootstrap: str | None = None, topic: str | None = None) -> str:
        keys_file = classes / f"keys-{uuid.uuid4().hex[:6]}.hex"
        keys_file.write_text("".join(k.encode().hex() + "\n" for k in keys))
        broker = [bootstrap, topic] if bootstrap else []
        done = subprocess.run([java, "-cp", f"{classes}:{classpath}", "Partitions", str(keys_file),
                               ",".join(map(str, counts)), *broker], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    return run


def partitions_of(run, keys: list[str], partitions: int) -> list[int]:
    """The partition the Java client's default partitioner picks for each key (``Utils.murmur2``)."""
    out = [0] * len(keys)
    for line in run(keys, (partitions,)).splitlines():
        _, _, i, utils, _ = line.split()
        out[int(i)] = int(utils)
    return out
