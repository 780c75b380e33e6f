"""Every Kafka client of the project reaches a secured broker from one ``KafkaSettings``, and a
refused password or an untrusted certificate ends a service in one line naming the broker.

Pure (no broker): the ``CHATPIPE_KAFKA_*`` variables and flags, the combinations refused at
construction, what librdkafka, Faust/aiokafka and Spark's Java client each get, secrets absent from
every printed form, and the one-line explanations of librdkafka's error strings.

With a real SASL_SSL broker (``infra.local_kafka`` with ``kafka_security=sasl_ssl``: SCRAM-SHA-512
over TLS, its own CA; started once for this module): the preflight check passes with the right
settings and explains a wrong password and an untrusted CA; ``chatpipe gateway`` exits 78 with one
line; confluent-kafka and Faust's aiokafka clients produce and consume through it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.spark.conftest import spark  # noqa: F401 - the test session's one local Spark
from transport.connect_check import EXIT_CONFIG, KafkaConnectError, check_connection, explain
from transport.settings import KafkaSettings, redacted

PASSWORD = "s3cret-\"pass\\word"  # a quote and a backslash: the JAAS line must escape both
KEY_PASSWORD = "key-pass-77"


@pytest.fixture(autouse=True)
def _no_chatpipe_env(monkeypatch):
    """Settings come from what each test gives, not from a developer's shell."""
    for var in [v for v in os.environ if v.startswith("CHATPIPE_")]:
        monkeypatch.delenv(var)


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    """A CA, a client certificate it signed and the certificate's key, plain and encrypted (PKCS#8)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make test certificates")
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"), "-days", "2", "-subj", "/CN=test CA")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(d / "client.key"), "-out", str(d / "client.csr"), "-subj", "/CN=chatpipe-test")
    _openssl("x509", "-req", "-in", str(d / "client.csr"), "-CA", str(d / "ca.pem"), "-CAkey", str(d / "ca.key"),
             "-CAcreateserial", "-days", "2", "-out", str(d / "client.pem"))
    _openssl("pkcs8", "-topk8", "-in", str(d / "client.key"), "-out", str(d / "client.enc.key"),
             "-passout", f"pass:{KEY_PASSWORD}")
    return {"ca": d / "ca.pem", "cert": d / "client.pem", "key": d / "client.key", "enc_key": d / "client.enc.key"}


def _sasl_ssl(pki, **extra) -> KafkaSettings:
    return KafkaSettings(bootstrap_servers="b1:9093,b2:9093", security_protocol="SASL_SSL",
                         sasl_mechanism="SCRAM-SHA-512", sasl_username="streams", sasl_password=PASSWORD,
                         ssl_ca_file=pki["ca"], **extra)


# --- settings: names, defaults, combinations ----------------------------------------------------------

def test_plaintext_default_adds_nothing_to_any_client():
    """Guards the unsecured stack: no security property reaches a client unless one was asked for."""
    k = KafkaSettings()
    assert k.client_config() == {"bootstrap.servers": "127.0.0.1:9092", "client.id": "chatpipe"}
    assert k.faust_broker_credentials() is None
    assert k.spark_kafka_options() == {"kafka.bootstrap.servers": "127.0.0.1:9092"}


def test_the_documented_kafka_variables_and_the_class_prefix_both_work(monkeypatch, pki):
    """Catches a field that only one of its two variable names fills (CHATPIPE_KAFKA_X and CHATPIPE_X),
    case-sensitive values, and CHATPIPE_BOOTSTRAP_SERVERS no longer read."""
    monkeypatch.setenv("CHATPIPE_BOOTSTRAP_SERVERS", "broker:9093")
    monkeypatch.setenv("CHATPIPE_KAFKA_SECURITY_PROTOCOL", "sasl_ssl")
    monkeypatch.setenv("CHATPIPE_KAFKA_SASL_MECHANISM", "scram-sha-256")
    monkeypatch.setenv("CHATPIPE_SASL_USERNAME", "gateway")  # the class prefix alone
    monkeypatch.setenv("CHATPIPE_KAFKA_SASL_PASSWORD", PASSWORD)
    monkeypatch.setenv("CHATPIPE_KAFKA_SSL_CA_FILE", str(pki["ca"]))
    monkeypatch.setenv("CHATPIPE_KAFKA_SSL_CHECK_HOSTNAME", "false")
    k = KafkaSettings()
    assert (k.bootstrap_servers, k.security_protocol, k.sasl_mechanism, k.sasl_username) == \
        ("broker:9093", "SASL_SSL", "SCRAM-SHA-256", "gateway")
    assert k.sasl_secret() == PASSWORD and k.ssl_ca_file == pki["ca"] and k.ssl_check_hostname is False
    # A flag (keyword by field name) wins over the environment.
    assert KafkaSettings(sasl_username="streams").sasl_username == "streams"


@pytest.mark.parametrize("fields, expected", [
    (dict(security_protocol="SASL_SSL", sasl_username="u", sasl_password="p"),
     "security_protocol SASL_SSL needs a sasl_mechanism (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or OAUTHBEARER)"),
    (dict(security_protocol="SASL_PLAINTEXT", sasl_mechanism="SCRAM-SHA-512", sasl_username="u"),
     "SASL SCRAM-SHA-512 needs a sasl_username and a sasl_password"),
    (dict(security_protocol="SASL_SSL", sasl_mechanism="OAUTHBEARER", sasl_username="client", sasl_password="p"),
     "SASL OAUTHBEARER needs sasl_oauth_token_url"),
    (dict(sasl_username="u"), "sasl_username is set but security_protocol is PLAINTEXT"),
    (dict(security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN", sasl_username="u", sasl_password="p",
          ssl_ca_file="CA"), "ssl_ca_file is set but security_protocol is SASL_PLAINTEXT"),
    (dict(security_protocol="SSL", ssl_cert_file="CERT"), "ssl_cert_file and ssl_key_file go together"),
    (dict(security_protocol="SSL", ssl_ca_file="/nonexistent/ca.pem"),
     "ssl_ca_file /nonexistent/ca.pem is not a readable file"),
])
def test_an_unusable_combination_fails_at_construction_in_one_line(fields, expected, pki):
    """Guards against settings that every client would only reject later (or never: a SASL user on a
    PLAINTEXT connection is silently ignored by librdkafka), and against multi-line pydantic dumps."""
    from chatpipe.commands.common import SettingsError, build_settings

    files = {"CA": str(pki["ca"]), "CERT": str(pki["cert"])}
    fields = {k: files.get(v, v) if isinstance(v, str) else v for k, v in fields.items()}
    with pytest.raises(SettingsError) as caught:
        build_settings(KafkaSettings, **fields)
    line = str(caught.value)
    assert expected in line and "\n" not in line
    assert "Value error" not in line and ": :" not in line
    assert "p'" not in line and "input_value" not in line  # the rejected input (a password) is not echoed


def test_protocol_and_mechanism_are_taken_in_any_case(pki):
    k = KafkaSettings(security_protocol="Sasl_Ssl", sasl_mechanism="scram_sha_512", sasl_username="u",
                      sasl_password="p", ssl_ca_file=pki["ca"])
    assert (k.security_protocol, k.sasl_mechanism) == ("SASL_SSL", "SCRAM-SHA-512")


# --- what each library gets ---------------------------------------------------------------------------

def test_librdkafka_gets_sasl_tls_and_the_client_certificate(pki):
    """Catches a property name librdkafka does not know, or one left out (every confluent-kafka
    client of the project spreads client_config(), so this is what all of them connect with)."""
    k = _sasl_ssl(pki, ssl_cert_file=pki["cert"], ssl_key_file=pki["enc_key"], ssl_key_password=KEY_PASSWORD,
                  ssl_check_hostname=False)
    config = k.client_config()
    assert config == {
        "bootstrap.servers": "b1:9093,b2:9093", "client.id": "chatpipe",
        "security.protocol": "sasl_ssl", "sasl.mechanisms": "SCRAM-SHA-512",
        "sasl.username": "streams", "sasl.password": PASSWORD,
        "ssl.ca.location": str(pki["ca"]), "ssl.certificate.location": str(pki["cert"]),
        "ssl.key.location": str(pki["enc_key"]), "ssl.key.password": KEY_PASSWORD,
        "ssl.endpoint.identification.algorithm": "none",
    }
    import logging

    from confluent_kafka.admin import AdminClient

    quiet = logging.getLogger("tests.security.librdkafka")
    quiet.propagate = False
    AdminClient({**config, "logger": quiet})  # librdkafka accepts every property, loads cert and key


def test_password_file_is_read_when_a_client_is_built(tmp_path):
    """A mounted secret (Kubernetes, Docker) instead of a variable; a rotated file is read again."""
    secret = tmp_path / "password"
    secret.write_text("first\n")
    k = KafkaSettings(security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN", sasl_username="u",
                      sasl_password_file=secret)
    assert k.client_config()["sasl.password"] == "first"
    secret.write_text("second\n")
    assert k.client_config()["sasl.password"] == "second"


def test_faust_gets_scram_credentials_over_a_context_that_trusts_the_ca(pki):
    """Faust's producer, consumers and topic creation all take their auth from
    ``credentials_to_aiokafka_auth(conf.broker_credentials, ...)``: check what it makes of ours."""
    import ssl

    from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

    k = _sasl_ssl(pki, ssl_cert_file=pki["cert"], ssl_key_file=pki["enc_key"], ssl_key_password=KEY_PASSWORD)
    auth = credentials_to_aiokafka_auth(k.faust_broker_credentials())
    assert {key: auth[key] for key in ("security_protocol", "sasl_mechanism", "sasl_plain_username",
                                       "sasl_plain_password")} == \
        {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": "streams",
         "sasl_plain_password": PASSWORD}
    context = auth["ssl_context"]
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert [c["subject"] for c in context.get_ca_certs()] == [((("commonName", "test CA"),),)]

    plain = KafkaSettings(security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN", sasl_username="u",
                          sasl_password="p")
    assert credentials_to_aiokafka_auth(plain.faust_broker_credentials())["security_protocol"] == "SASL_PLAINTEXT"
    tls = KafkaSettings(security_protocol="SSL", ssl_ca_file=pki["ca"], ssl_check_hostname=False)
    auth = credentials_to_aiokafka_auth(tls.faust_broker_credentials())
    assert auth["security_protocol"] == "SSL" and auth["ssl_context"].check_hostname is False


def test_faust_app_is_built_with_the_credentials(pki, tmp_path):
    """Catches streams/app.py building its faust.App without ``broker_credentials``."""
    from faust.auth import SASLCredentials

    from streams.app import StreamsApp
    from streams.erasures import ErasureRegistry
    from streams.settings import StreamsSettings
    from transport.spans import Tracer

    class NoServices:  # building the app touches no service (nothing runs until the worker starts)
        codec = None
        tracer = Tracer("streams")

    streams = StreamsApp(_sasl_ssl(pki), StreamsSettings(state_dir=tmp_path / "state"), NoServices(),
                         erasures=ErasureRegistry())
    streams.reply_producer.close(timeout_s=1)
    credentials = streams.app.conf.broker_credentials
    assert isinstance(credentials, SASLCredentials) and credentials.username == "streams"
    assert credentials.mechanism.value == "SCRAM-SHA-512" and credentials.ssl_context is not None


def test_spark_gets_jaas_pem_truststore_and_keystore(pki):
    """Catches a JAAS line the Java client cannot parse (unescaped quote or backslash in the password)
    and a missing PEM type (the Java client defaults to JKS)."""
    k = _sasl_ssl(pki, ssl_cert_file=pki["cert"], ssl_key_file=pki["enc_key"], ssl_key_password=KEY_PASSWORD)
    options = k.spark_kafka_options()
    assert options["kafka.security.protocol"] == "SASL_SSL"
    assert options["kafka.sasl.mechanism"] == "SCRAM-SHA-512"
    assert options["kafka.sasl.jaas.config"] == (
        'org.apache.kafka.common.security.scram.ScramLoginModule required '
        'username="streams" password="s3cret-\\"pass\\\\word";')
    assert options["kafka.ssl.truststore.type"] == "PEM"
    assert options["kafka.ssl.truststore.location"] == str(pki["ca"])
    assert options["kafka.ssl.keystore.type"] == "PEM"
    assert options["kafka.ssl.keystore.certificate.chain"].startswith("-----BEGIN CERTIFICATE-----")
    assert options["kafka.ssl.keystore.key"].startswith("-----BEGIN ENCRYPTED PRIVATE KEY-----")
    assert options["kafka.ssl.key.password"] == KEY_PASSWORD
    assert options["kafka.ssl.endpoint.identification.algorithm"] == "https"
    plain = KafkaSettings(security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN", sasl_username="u",
                          sasl_password="p").spark_kafka_options()
    assert plain["kafka.sasl.jaas.config"].startswith("org.apache.kafka.common.security.plain.PlainLoginModule ")


def test_oauthbearer_maps_to_each_library_own_oidc_client(pki):
    """OAUTHBEARER (client-credentials grant): librdkafka's built-in OIDC, the Java client's
    OAuthBearerLoginCallbackHandler, and for aiokafka our token provider."""
    from faust.auth import OAuthCredentials

    k = KafkaSettings(security_protocol="SASL_SSL", sasl_mechanism="OAUTHBEARER", sasl_username="client-1",
                      sasl_password=PASSWORD, sasl_oauth_token_url="https://idp.example/token",
                      sasl_oauth_scope="kafka", ssl_ca_file=pki["ca"])
    config = k.client_config()
    assert {key: config[key] for key in config if key.startswith("sasl.")} == {
        "sasl.mechanisms": "OAUTHBEARER", "sasl.oauthbearer.method": "oidc",
        "sasl.oauthbearer.client.id": "client-1", "sasl.oauthbearer.client.secret": PASSWORD,
        "sasl.oauthbearer.token.endpoint.url": "https://idp.example/token", "sasl.oauthbearer.scope": "kafka"}
    options = k.spark_kafka_options()
    assert options["kafka.sasl.jaas.config"].startswith(
        "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule required clientId=\"client-1\"")
    assert options["kafka.sasl.oauthbearer.token.endpoint.url"] == "https://idp.example/token"
    credentials = k.faust_broker_credentials()
    assert isinstance(credentials, OAuthCredentials) and PASSWORD not in repr(credentials.oauth_cb)


def test_the_aiokafka_token_provider_does_the_client_credentials_grant(pki):
    """aiokafka has no OIDC client of its own: ours must post the grant with the client id and secret
    (HTTP basic) and keep the token until shortly before it expires."""
    import base64
    import http.server
    import threading
    import urllib.parse

    from transport.oauth import OidcTokenProvider

    asked = []

    class TokenEndpoint(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # http.server's name
            form = urllib.parse.parse_qs(self.rfile.read(int(self.headers["Content-Length"])).decode())
            asked.append((self.headers["Authorization"], form))
            body = f'{{"access_token": "token-{len(asked)}", "expires_in": 3600}}'.encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), TokenEndpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        k = KafkaSettings(security_protocol="SASL_SSL", sasl_mechanism="OAUTHBEARER", sasl_username="client-1",
                          sasl_password=PASSWORD, sasl_oauth_scope="kafka", ssl_ca_file=pki["ca"],
                          sasl_oauth_token_url=f"http://127.0.0.1:{server.server_port}/token")
        provider = OidcTokenProvider(k)

        async def twice() -> list[str]:
            return [await provider.token(), await provider.token()]

        assert asyncio.run(twice()) == ["token-1", "token-1"]  # the second from the cache
    finally:
        server.shutdown()
    (authorization, form), = asked
    assert authorization == "Basic " + base64.b64encode(f"client-1:{PASSWORD}".encode()).decode()
    assert form == {"grant_type": ["client_credentials"], "scope": ["kafka"]}


# --- secrets never printed ------------------------------------------------------------------------------

def test_no_printed_form_of_the_settings_holds_a_secret(pki):
    """The password and the key password must not appear in repr/str (logs, tracebacks), in the
    redacted client and Spark configs (the only form to log), in the security summary line, nor in
    the repr of Faust's credentials (Faust logs its conf)."""
    k = _sasl_ssl(pki, ssl_cert_file=pki["cert"], ssl_key_file=pki["enc_key"], ssl_key_password=KEY_PASSWORD)
    printed = [repr(k), str(k), k.describe_security(), str(redacted(k.client_config())),
               str(redacted(k.spark_kafka_options())), repr(k.faust_broker_credentials()),
               str(k.model_dump())]
    for text in printed:
        assert PASSWORD not in text and KEY_PASSWORD not in text
        assert "BEGIN ENCRYPTED PRIVATE KEY" not in text
    assert "SCRAM-SHA-512 as 'streams'" in k.describe_security()


def test_a_rejected_setting_does_not_echo_the_password():
    """pydantic's default error text includes the input: with the password in it."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as caught:
        KafkaSettings(security_protocol="SASL_SSL", sasl_mechanism="GSSAPI", sasl_username="u",
                      sasl_password="hunter2-secret")
    assert "hunter2-secret" not in str(caught.value) and "hunter2-secret" not in repr(caught.value.errors())


# --- librdkafka's errors, explained -----------------------------------------------------------------

# Strings as librdkafka 2.x reports them (taken from the SASL_SSL broker below).
AUTH_FAILED = ("sasl_ssl://127.0.0.1:19093/bootstrap: SASL authentication error: Authentication failed during "
               "authentication due to invalid credentials with SASL mechanism SCRAM-SHA-512 (after 362ms in "
               "state AUTH_REQ)")
NOT_TRUSTED = ("sasl_ssl://127.0.0.1:19093/bootstrap: SSL handshake failed: error:0A000086:SSL routines::"
               "certificate verify failed: broker certificate could not be verified, verify that ssl.ca.location "
               "is correctly configured or root CA certificates are installed (install ca-certificates package) "
               "(after 21ms in state SSL_HANDSHAKE)")
TLS_TO_PLAINTEXT = ("ssl://127.0.0.1:9092/bootstrap: SSL handshake failed: error:0A00010B:SSL routines::wrong "
                    "version number (after 3ms in state SSL_HANDSHAKE)")
PLAINTEXT_TO_TLS = ("127.0.0.1:19093/bootstrap: Disconnected: connection closed by peer: receive 0 after POLLIN "
                    "(after 1ms in state APIVERSION_QUERY)")
REFUSED = "sasl_ssl://127.0.0.1:19999/bootstrap: Connect to ipv4#127.0.0.1:19999 failed: Connection refused"


def test_each_lasting_error_becomes_one_line_naming_the_broker(pki):
    k = KafkaSettings(bootstrap_servers="127.0.0.1:19093", security_protocol="SASL_SSL",
                      sasl_mechanism="SCRAM-SHA-512", sasl_username="streams", sasl_password=PASSWORD,
                      ssl_ca_file=pki["ca"])
    assert explain(k, ["1/1 brokers are down", AUTH_FAILED]) == (
        "Kafka at 127.0.0.1:19093 refused the SASL credentials of user 'streams' (SCRAM-SHA-512): "
        "authentication failed")
    assert explain(k, [NOT_TRUSTED]) == (
        f"the TLS certificate of Kafka at 127.0.0.1:19093 is not trusted by --kafka-ssl-ca-file {pki['ca']} "
        "(certificate verify failed)")
    assert "does not speak TLS on this port" in explain(k, [TLS_TO_PLAINTEXT])
    plaintext = KafkaSettings(bootstrap_servers="127.0.0.1:19093")
    assert explain(plaintext, [PLAINTEXT_TO_TLS]) is None  # once: may be a broker going down
    assert "probably expects TLS (SSL or SASL_SSL), not PLAINTEXT" in explain(plaintext, [PLAINTEXT_TO_TLS] * 5)


def test_an_unreachable_broker_is_an_outage_not_a_config_error():
    """Connection refused must not end a service with 78: the broker may be starting; the services'
    own retries handle it. And the check gives up at once instead of waiting its whole timeout."""
    import time

    k = KafkaSettings(bootstrap_servers="127.0.0.1:9", security_protocol="SASL_PLAINTEXT",
                      sasl_mechanism="PLAIN", sasl_username="u", sasl_password="p")
    assert explain(k, [REFUSED, "1/1 brokers are down"]) is None
    started = time.monotonic()
    assert check_connection(k, timeout_s=20) is False
    assert time.monotonic() - started < 10


# --- against a real SASL_SSL broker -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def secured_broker(tmp_path_factory):
    """A SASL_SSL broker of our own (``chatpipe up --kafka-security sasl_ssl``'s), its admin user's settings."""
    from chatpipe.testing.ports import free_port
    from infra.kafka_security import ADMIN_USER
    from infra.local_kafka import LocalKafka
    from infra.settings import StackSettings

    stack = StackSettings(state_dir=tmp_path_factory.mktemp("secured"), kafka_port=free_port(),
                          controller_port=free_port(), kafka_security="sasl_ssl")
    broker = LocalKafka(stack)
    try:
        broker.up()
        sec = broker.security
        kafka = KafkaSettings(bootstrap_servers=stack.bootstrap_servers, security_protocol="SASL_SSL",
                              sasl_mechanism="SCRAM-SHA-512", sasl_username=ADMIN_USER,
                              sasl_password=sec.password(ADMIN_USER), ssl_ca_file=sec.ca_file,
                              topic_prefix=f"s{uuid.uuid4().hex[:6]}.")
        yield kafka
    finally:
        broker.down()


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory) -> Path:
    """A CA that did not sign the broker's certificate."""
    d = tmp_path_factory.mktemp("other-ca")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"), "-days", "2", "-subj", "/CN=not the broker's CA")
    return d / "ca.pem"


@pytest.mark.integration
def test_preflight_passes_and_explains_a_wrong_password_and_an_untrusted_ca(secured_broker, other_ca):
    assert check_connection(secured_broker) is True
    wrong = secured_broker.model_copy(update={"sasl_password": __import__("pydantic").SecretStr("not-it")})
    with pytest.raises(KafkaConnectError) as refused:
        check_connection(wrong)
    assert str(refused.value) == (f"Kafka at {secured_broker.bootstrap_servers} refused the SASL credentials of "
                                  f"user '{secured_broker.sasl_username}' (SCRAM-SHA-512): authentication failed")
    untrusted = secured_broker.model_copy(update={"ssl_ca_file": other_ca})
    with pytest.raises(KafkaConnectError) as not_trusted:
        check_connection(untrusted)
    assert str(not_trusted.value) == (f"the TLS certificate of Kafka at {secured_broker.bootstrap_servers} is not "
                                      f"trusted by --kafka-ssl-ca-file {other_ca} (certificate verify failed)")
    plaintext = KafkaSettings(bootstrap_servers=secured_broker.bootstrap_servers)
    with pytest.raises(KafkaConnectError, match="probably expects TLS"):
        check_connection(plaintext)


def _service_env(kafka: KafkaSettings, **override: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATPIPE_")}
    env.update({"CHATPIPE_BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
                "CHATPIPE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "CHATPIPE_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
                "CHATPIPE_KAFKA_SASL_USERNAME": kafka.sasl_username,
                "CHATPIPE_KAFKA_SASL_PASSWORD": kafka.sasl_secret(),
                "CHATPIPE_KAFKA_SSL_CA_FILE": str(kafka.ssl_ca_file), **override})
    return env


@pytest.mark.integration
@pytest.mark.parametrize("service, case", [("gateway", "wrong password"), ("gateway", "untrusted CA"),
                                           ("streams", "wrong password"), ("inference", "untrusted CA")])
def test_a_service_ends_in_one_line_and_code_78(secured_broker, other_ca, service, case, tmp_path):
    """The Done-when line: a wrong password and an untrusted certificate each end the service in one
    clear line naming the broker, with EX_CONFIG (no retry loop, no traceback, no password)."""
    from chatpipe.testing.ports import free_port

    override = {"CHATPIPE_KAFKA_SASL_PASSWORD": "wrong-password-123"} if case == "wrong password" else {}
    flags = ["--kafka-ssl-ca-file", str(other_ca)] if case == "untrusted CA" else []
    if service == "gateway":
        flags += ["--port", str(free_port())]
    proc = subprocess.run([sys.executable, "-m", "chatpipe.cli", service, *flags],
                          env=_service_env(secured_broker, **override), capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == EXIT_CONFIG, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"chatpipe {service}: ") and secured_broker.bootstrap_servers in lines[0]
    assert ("refused the SASL credentials" if case == "wrong password" else "is not trusted by") in lines[0]
    assert secured_broker.sasl_secret() not in proc.stderr + proc.stdout
    assert "wrong-password-123" not in proc.stderr + proc.stdout


@pytest.mark.integration
def test_confluent_and_faust_clients_produce_and_consume_through_sasl_ssl(secured_broker):
    """The same settings object gets librdkafka and aiokafka (Faust's client, with Faust's own
    translation of the credentials) through SCRAM over TLS, both ways."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
    from confluent_kafka import Consumer, Producer
    from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

    from transport.admin import TopicAdmin

    topic = secured_broker.topic("secured.roundtrip")
    TopicAdmin(secured_broker).create_topic(topic, 1, None)
    producer = Producer(secured_broker.client_config())
    producer.produce(topic, key=b"k", value=b"from librdkafka")
    assert producer.flush(30) == 0
    auth = credentials_to_aiokafka_auth(secured_broker.faust_broker_credentials())

    async def through_aiokafka() -> list[bytes]:
        out = AIOKafkaProducer(bootstrap_servers=secured_broker.bootstrap_servers, **auth)
        await out.start()
        try:
            await out.send_and_wait(topic, b"from aiokafka", key=b"k")
        finally:
            await out.stop()
        into = AIOKafkaConsumer(topic, bootstrap_servers=secured_broker.bootstrap_servers,
                                auto_offset_reset="earliest", group_id=None, **auth)
        await into.start()
        try:
            batches = await into.getmany(timeout_ms=10_000, max_records=2)
            return [m.value for ms in batches.values() for m in ms]
        finally:
            await into.stop()

    assert sorted(asyncio.run(through_aiokafka())) == [b"from aiokafka", b"from librdkafka"]
    consumer = Consumer({**secured_broker.client_config(), "group.id": f"g-{uuid.uuid4().hex[:6]}",
                         "auto.offset.reset": "earliest"})
    try:
        consumer.subscribe([topic])
        values = []
        for _ in range(30):
            message = consumer.poll(1.0)
            if message is not None and message.error() is None:
                values.append(message.value())
            if len(values) == 2:
                break
        assert sorted(values) == [b"from aiokafka", b"from librdkafka"]
    finally:
        consumer.close()


def _add_user(admin_settings: KafkaSettings, user: str, password: str, topic: str) -> None:
    """A SCRAM-SHA-512 user with ``password``, allowed to read ``topic`` (the broker denies what no ACL allows)."""
    from confluent_kafka.admin import (AclBinding, AclOperation, AclPermissionType, AdminClient, ResourcePatternType,
                                       ResourceType, ScramCredentialInfo, ScramMechanism, UserScramCredentialUpsertion)

    admin = AdminClient({**admin_settings.client_config(), "log_level": 0})
    upsert = UserScramCredentialUpsertion(user, ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 4096),
                                          password.encode())
    for future in admin.alter_user_scram_credentials([upsert]).values():
        future.result(timeout=30)
    acls = [AclBinding(kind, name, ResourcePatternType.LITERAL, f"User:{user}", "*", AclOperation[op],
                       AclPermissionType.ALLOW)
            for kind, name in ((ResourceType.TOPIC, topic), (ResourceType.GROUP, "*")) for op in ("READ", "DESCRIBE")]
    for future in admin.create_acls(acls).values():
        future.result(timeout=30)


@pytest.mark.integration
@pytest.mark.spark
def test_spark_and_every_client_log_in_with_a_password_holding_quote_and_backslash(secured_broker, spark):  # noqa: F811 - spark: the fixture imported above
    """Spark's Kafka source (the Java client: JAAS line, PEM truststore) reads a topic through SASL_SSL
    with the same settings object, for a password that breaks an unescaped JAAS line; librdkafka and
    aiokafka log in with it too."""
    from confluent_kafka import Producer

    from spark_jobs.sources import read_kafka
    from transport.admin import TopicAdmin

    topic = secured_broker.topic("secured.spark")
    TopicAdmin(secured_broker).create_topic(topic, 2, None)
    producer = Producer(secured_broker.client_config())
    for i in range(5):
        producer.produce(topic, key=f"k{i}".encode(), value=f"v{i}".encode())
    assert producer.flush(30) == 0
    del producer
    user = f"odd-{uuid.uuid4().hex[:6]}"
    _add_user(secured_broker, user, PASSWORD, topic)
    odd = secured_broker.model_copy(update={"sasl_username": user,
                                            "sasl_password": __import__("pydantic").SecretStr(PASSWORD)})
    assert check_connection(odd) is True  # librdkafka

    from aiokafka import AIOKafkaProducer
    from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

    async def aiokafka_partitions() -> set[int]:
        client = AIOKafkaProducer(bootstrap_servers=odd.bootstrap_servers,
                                  **credentials_to_aiokafka_auth(odd.faust_broker_credentials()))
        await client.start()  # fails unless logged in
        try:
            return await client.partitions_for(topic)  # the user's ACL lets it see the topic
        finally:
            await client.stop()

    assert asyncio.run(aiokafka_partitions()) == {0, 1}
    rows = read_kafka(spark, odd.spark_kafka_options(), topic).select("value").collect()
    assert sorted(bytes(r.value) for r in rows) == [f"v{i}".encode() for i in range(5)]


def test_each_service_may_write_every_topic_its_code_produces_to():
    """The local broker's ACLs (infra/kafka_security.py) against what each tier produces: a topic
    missing here is a denial in production, e.g. streams' per-partition forget audits on
    chat.deletions.audit (streams/forget.py ForgetPartition), which the pipeline test sends none of."""
    from infra.kafka_security import _topic_rules
    from schemas import topics as t

    produced = {  # where: streams/app.py + intake/record/forget, inference/worker, gateway
        "streams": {t.INFERENCE_REQUESTS, t.INFERENCE_REQUESTS_BATCH, t.TURNS, t.DLQ, t.DELETIONS_FANOUT,
                    t.DELETIONS_AUDIT, f"{t.REPLIES}.gw-1"},
        "inference": {t.RESPONSES, t.WORKERS_STATUS, t.DELETIONS_AUDIT, t.DLQ, f"{t.REPLIES}.gw-1"},
        "gateway": {t.PROMPTS, t.CANCELS, t.FEEDBACK, t.DELETIONS, f"{t.REPLIES}.gw-1"},
    }
    for service, topics in produced.items():
        rules = _topic_rules(service)
        for topic in topics:
            allowed = any("WRITE" in ops and (name == topic if kind == "LITERAL" else topic.startswith(name))
                          for kind, name, ops in rules)
            assert allowed, f"{service} may not write {topic}"
