"""The whole pipeline on a SASL_SSL broker (``chatpipe up --kafka-security sasl_ssl``): a chat request
through the gateway is answered by the streams tier and the inference worker (the real small model),
its turn is on ``chat.turns``, and a Spark job with ``--source kafka`` reads it back, every one of
them logged in as its own SCRAM user over TLS. Then what a misconfigured client gets: a wrong
password and a CA the broker's certificate does not come from each end in one line naming the
broker. And the ACLs: the jobs user only reads, a service does not delete topics.

One stack for the module (``conftest.py``); about two minutes on 2 cores, most of it the Spark job.
"""

from __future__ import annotations

import json
import re
import stat
import subprocess
import time
import urllib.request

import pytest

from chatpipe.testing.ports import free_port
from infra.kafka_security import ADMIN_USER, SERVICE_USERS, USERS, make_ca
from schemas.codec import default_codec
from schemas.records import ConversationTurn
from tests.faults.stack import cli

pytestmark = [pytest.mark.integration, pytest.mark.model, pytest.mark.spark]

MODEL = "smollm2-135m-instruct"
_no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _chat(stack, content: str) -> dict:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 12}).encode()
    request = urllib.request.Request(f"{stack.gateway_url}/v1/chat/completions", data=body, method="POST",
                                     headers={"Authorization": f"Bearer {stack.api_key}",
                                              "Content-Type": "application/json"})
    with _no_proxy.open(request, timeout=180) as reply:
        return json.loads(reply.read())


def _turn_of(stack, request_id: str, timeout_s: float = 60) -> ConversationTurn | None:
    """The turn of ``request_id`` on chat.turns, read as the jobs user (from the beginning)."""
    from confluent_kafka import Consumer, TopicPartition

    kafka = stack.kafka_settings(SERVICE_USERS["jobs"])
    consumer = Consumer({**kafka.client_config(), "group.id": "test-secured-turns", "enable.auto.commit": False})
    codec = default_codec()
    try:
        topic = kafka.topic("chat.turns")
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])  # 0: the first offset
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            message = consumer.poll(1.0)
            if message is None or message.error():
                continue
            turn = codec.decode(message.value(), ConversationTurn)
            if turn.request_id == request_id:
                return turn
        return None
    finally:
        consumer.close()


def _one_line(result) -> str:
    """The command's whole output, which must be one line (no traceback, no librdkafka screen)."""
    output = (result.stdout + result.stderr).strip()
    lines = output.splitlines()
    assert len(lines) == 1, output[-3000:]
    return lines[0]


def _no_password_in(stack, *texts: str) -> None:
    """No password of the stack's users in ``texts``, in any log of the state folder, nor in the
    supervisor's spec (the services' environment: they get a password file's path)."""
    logs = [p for folder in (stack.state / "logs", stack.state / "kafka" / "logs") for p in folder.rglob("*")
            if p.is_file()] + [stack.state / "run" / "supervisor-spec.json", stack.state / "stack.json"]
    for user, password in stack.security.passwords().items():
        for text in texts:
            assert password not in text, f"{user}'s password printed"
        for log in logs:
            assert password not in log.read_text(errors="replace"), f"{user}'s password in {log}"


def test_chat_turn_and_spark_job_over_sasl_ssl(secured_stack, tmp_path):
    """Catches a tier that cannot reach the secured broker (no credentials passed, a client library not
    given the CA, an ACL missing): the request would time out, its turn never appear, or the Spark job
    fail or read nothing. And `status` must say how the broker is secured without a password."""
    stack = secured_stack
    reply = _chat(stack, "Say hello to the secured broker.")
    request_id = reply["id"].removeprefix("chatcmpl-")
    assert reply["choices"][0]["message"]["content"], reply

    turn = _turn_of(stack, request_id)
    assert turn is not None, f"no turn of {request_id} on chat.turns"
    assert turn.model == MODEL and turn.tokens_out == reply["usage"]["completion_tokens"]

    # A Spark job reading the turns from the broker, as the jobs user (Spark's Java Kafka client).
    out = tmp_path / "report"
    job = cli("job", "usage-report", "--out", str(out), "--source", "kafka", "--bootstrap-servers", stack.bootstrap,
              "--quiet", timeout=300, env=stack.env(SERVICE_USERS["jobs"]))
    assert job.returncode == 0, (job.stdout + job.stderr)[-3000:]
    import pandas as pd

    usage = pd.read_parquet(out / "usage.parquet")
    row = usage[usage["model"] == MODEL]
    assert int(row["requests"].sum()) == 1 and int(row["tokens_out"].sum()) == turn.tokens_out, usage.to_string()

    status = cli("status", "--state-dir", str(stack.state), timeout=120)
    assert status.returncode == 0, status.stdout + status.stderr  # every service healthy on the secured broker
    kafka_row = " ".join(line for line in status.stdout.splitlines() if "SASL_SSL" in line or "CA" in line)
    assert "SASL_SSL SCRAM-SHA-512" in kafka_row and ADMIN_USER in kafka_row, status.stdout
    as_json = cli("status", "--state-dir", str(stack.state), "--json", timeout=120)
    kafka = next(s for s in json.loads(as_json.stdout)["services"] if s["name"] == "kafka")
    assert "SASL_SSL" in kafka["address"]
    # A shell's client with the admin user's env file, as `chatpipe up` says: the catalog CLI works.
    admin_env = dict(line.split("=", 1) for line in stack.security.env_file(ADMIN_USER).read_text().splitlines())
    topics = cli("topics", "apply", "--bootstrap-servers", stack.bootstrap, timeout=120, env=admin_env)
    assert topics.returncode == 0 and "nothing to change" in topics.stdout, topics.stdout + topics.stderr
    _no_password_in(stack, stack.up_output, status.stdout, as_json.stdout, job.stdout + job.stderr,
                    topics.stdout + topics.stderr)
    # Every service did all of the above within its ACLs: the broker's authorizer refused nothing.
    denied = [line for line in (stack.state / "kafka" / "logs" / "server.log").read_text().splitlines()
              if "is Denied operation" in line]
    assert denied == [], "\n".join(denied[:20])


def test_wrong_password_is_one_line_naming_the_broker(secured_stack, tmp_path):
    """Catches a refused login that retries forever or prints a screen of librdkafka/Java lines: the
    Spark job must stop before Spark starts, in one line naming the broker and the user."""
    stack = secured_stack
    user = SERVICE_USERS["jobs"]
    wrong = tmp_path / "wrong.password"
    wrong.write_text("not-the-password\n")
    result = cli("job", "usage-report", "--out", str(tmp_path / "report"), "--source", "kafka",
                 "--bootstrap-servers", stack.bootstrap, "--quiet", timeout=120,
                 env=stack.env(user, CHATPIPE_KAFKA_SASL_PASSWORD_FILE=str(wrong)))
    assert result.returncode != 0
    line = _one_line(result)
    assert stack.bootstrap in line and user in line, line
    assert re.search(r"password|authenticat|credential", line, re.I), line
    assert "not-the-password" not in line and not (tmp_path / "report").exists()


def test_untrusted_certificate_is_one_line_naming_the_broker(secured_stack, tmp_path):
    """Catches a TLS handshake failure that looks like an outage (the service retrying, restarted by
    the supervisor for ever): a service trusting another CA must end at once, in one line naming the
    broker and the CA file, with the configuration-error exit code."""
    stack = secured_stack
    other_ca = make_ca(tmp_path / "other-ca", "a CA the broker's certificate does not come from")
    result = cli("gateway", "--bootstrap-servers", stack.bootstrap, "--port", str(free_port()), "--keys-file",
                 str(stack.state / "gateway" / "keys.json"), timeout=120,
                 env=stack.env(SERVICE_USERS["gateway"], CHATPIPE_KAFKA_SSL_CA_FILE=str(other_ca)))
    assert result.returncode == 78, (result.stdout + result.stderr)[-3000:]
    line = _one_line(result)
    assert stack.bootstrap in line and "certificate" in line.lower(), line


def test_acls_keep_each_user_to_its_part(secured_stack):
    """Catches ACLs that allow everything (or were never created): the jobs user must not write a
    prompt, a service must not delete a catalog topic; the admin user may describe everything."""
    from confluent_kafka import KafkaError, Producer
    from confluent_kafka.admin import AdminClient

    stack = secured_stack
    jobs = stack.kafka_settings(SERVICE_USERS["jobs"])
    errors = []
    producer = Producer({**jobs.client_config(), "message.timeout.ms": 10000})
    producer.produce(jobs.topic("chat.prompts"), b"x", on_delivery=lambda err, msg: errors.append(err))
    producer.flush(15)
    assert errors and errors[0] is not None and errors[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, errors

    gateway = AdminClient(stack.kafka_settings(SERVICE_USERS["gateway"]).client_config())
    future = gateway.delete_topics([jobs.topic("chat.turns")], operation_timeout=10)[jobs.topic("chat.turns")]
    with pytest.raises(Exception) as refused:
        future.result(timeout=15)
    assert "TOPIC_AUTHORIZATION_FAILED" in str(refused.value) or "authoriz" in str(refused.value).lower()

    admin = AdminClient(stack.kafka_settings(ADMIN_USER).client_config())
    assert jobs.topic("chat.turns") in admin.list_topics(timeout=10).topics  # not deleted, and visible


def test_broker_files_are_private_and_the_certificate_names_the_host(secured_stack):
    """Catches a secret readable by others (a 0644 password or key file) or a broker certificate
    that a client checking the host name would refuse (no 127.0.0.1 / localhost in its SAN)."""
    security = secured_stack.security
    assert stat.S_IMODE(security.folder.stat().st_mode) == 0o700
    private = [security.credentials_file, security.keystore, security.ca_key,
               secured_stack.state / "kafka" / "server.properties",  # holds the broker's own login
               *[security.password_file(u) for u in USERS], *[security.env_file(u) for u in USERS]]
    assert {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in private} == {str(p): "0o600" for p in private}
    verify = subprocess.run(["openssl", "verify", "-CAfile", str(security.ca_file), str(security.keystore)],
                            capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    san = subprocess.run(["openssl", "x509", "-in", str(security.keystore), "-noout", "-ext", "subjectAltName"],
                         capture_output=True, text=True).stdout
    assert "IP Address:127.0.0.1" in san and "DNS:localhost" in san, san


def test_a_plaintext_broker_or_a_cluster_is_refused_in_one_line(tmp_path):
    """Catches `--kafka-security sasl_ssl` silently ignored on a cluster, or a broker formatted
    without SCRAM users started with a SASL listener nobody can log in to."""
    refused = cli("up", "--state-dir", str(tmp_path / "cluster"), "--brokers", "3", "--kafka-security", "sasl_ssl",
                  timeout=60)
    assert refused.returncode == 1
    assert "one-broker stack only" in " ".join((refused.stdout + refused.stderr).split())
    assert not (tmp_path / "cluster").exists()

    from infra.local_kafka import BrokerStartError, LocalKafka
    from infra.settings import StackSettings

    state = tmp_path / "plain"
    LocalKafka(StackSettings(state_dir=state)).prepare()  # formats the data folder, starts nothing
    with pytest.raises(BrokerStartError, match="formatted without SCRAM users"):
        LocalKafka(StackSettings(state_dir=state, kafka_security="sasl_ssl")).prepare()
