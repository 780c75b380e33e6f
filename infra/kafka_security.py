"""What a secured local broker (``chatpipe up --kafka-security sasl_ssl``) is made of: a CA, the
broker's certificate and the SCRAM users of the services, all under ``<state>/kafka/security``.

- ``ca.pem`` / ``ca.key``: a self-signed CA made with openssl, for this state folder only; clients
  trust ``ca.pem`` (``CHATPIPE_KAFKA_SSL_CA_FILE``).
- ``broker.pem``: the broker's private key and its certificate (SAN ``IP:127.0.0.1``,
  ``DNS:localhost`` and the stack's host), the PEM keystore of the broker (``ssl.keystore.type=PEM``).
- ``credentials.json`` (0600): one SCRAM-SHA-512 user per service and an admin user, random
  passwords; the broker gets them at format time (``StorageTool format --add-scram``). Never printed.
- ``<user>.password`` (0600): that user's password alone. A service is given the file's path
  (``CHATPIPE_KAFKA_SASL_PASSWORD_FILE``), not the password: its environment, the supervisor's spec
  file and ``/proc/<pid>/environ`` hold no secret.
- ``<user>.env`` (0600): the ``CHATPIPE_KAFKA_*`` variables of one user, for a shell
  (``set -a; . <state>/kafka/security/chatpipe-admin.env; set +a`` before ``chatpipe topics list``).

Everything is made once and kept: a broker formatted with these users must keep getting the same
passwords. ACLs: ``service_acls`` (StandardAuthorizer; the admin user is a super user).

Not here: the broker's properties (``infra.local_kafka``), the clients' settings
(``transport.settings.KafkaSettings``).
"""

from __future__ import annotations

import concurrent.futures
import ipaddress
import json
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from infra.services import write_atomically
from schemas.errors import ChatpipeError

PROTOCOL = "SASL_SSL"
MECHANISM = "SCRAM-SHA-512"
ADMIN_USER = "chatpipe-admin"  # the broker's own inter-broker user, super user; the stack's admin client and CLI
# One principal per client of the stack. `chatpipe-jobs`: the Spark jobs (read chat.turns & co).
SERVICE_USERS = {"gateway": "chatpipe-gateway", "streams": "chatpipe-streams", "inference": "chatpipe-inference",
                 "jobs": "chatpipe-jobs"}
USERS = (ADMIN_USER, *SERVICE_USERS.values())
# The broker certificate's subject, as Kafka names the principal of a TLS client presenting it.
BROKER_SUBJECT = "/O=chatpipe/CN=chatpipe-broker"
BROKER_CERT_PRINCIPAL = "CN=chatpipe-broker,O=chatpipe"
CERT_DAYS = 825  # what clients such as macOS still accept for a leaf certificate
PRIVATE = 0o600  # the mode of every file holding a key or a password: never readable by others, even for a moment


class SecurityError(ChatpipeError):
    """The secured broker's certificates or credentials cannot be made or read."""


@dataclass(frozen=True, slots=True)
class BrokerSecurity:
    """The files of one state folder's secured broker (``ensure`` makes what is missing)."""

    folder: Path

    @property
    def ca_file(self) -> Path:
        return self.folder / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.folder / "ca.key"

    @property
    def keystore(self) -> Path:
        """The broker's private key followed by its certificate and the CA's (PEM keystore)."""
        return self.folder / "broker.pem"

    @property
    def credentials_file(self) -> Path:
        return self.folder / "credentials.json"

    def env_file(self, user: str) -> Path:
        return self.folder / f"{user}.env"

    def password_file(self, user: str) -> Path:
        return self.folder / f"{user}.password"

    def exists(self) -> bool:
        return self.ca_file.exists() and self.keystore.exists() and self.credentials_file.exists()

    def ensure(self, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> None:
        """CA, broker certificate and credentials, made once (kept on every later start)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        os.chmod(self.folder, 0o700)
        if not (self.ca_file.exists() and self.ca_key.exists()):
            make_ca(self.folder, "chatpipe local CA")
        if not self.keystore.exists():
            self._make_broker_cert(hosts)
        if not self.credentials_file.exists():
            write_atomically(self.credentials_file, json.dumps(
                {"mechanism": MECHANISM, "users": {user: secrets.token_urlsafe(24) for user in USERS}}, indent=1),
                PRIVATE)
        for user in USERS:
            if not self.password_file(user).exists():
                write_atomically(self.password_file(user), self.password(user) + "\n", PRIVATE)
            if not self.env_file(user).exists():
                write_atomically(self.env_file(user), "".join(f"{k}={v}\n" for k, v in self.client_env(user).items()),
                                 PRIVATE)

    def _make_broker_cert(self, hosts: tuple[str, ...]) -> None:
        work = self.folder / "broker.tmp"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(mode=0o700)
        try:
            names = sorted({*hosts, "127.0.0.1", "localhost"})
            san = ",".join(f"IP:{h}" if _is_ip(h) else f"DNS:{h}" for h in names)
            (work / "ext.cnf").write_text(
                f"subjectAltName={san}\nbasicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
                # clientAuth too: the broker presents the same certificate to its own controller listener.
                "extendedKeyUsage=serverAuth,clientAuth\n")
            _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(work / "broker.key"),
                     "-out", str(work / "broker.csr"), "-subj", BROKER_SUBJECT)
            _openssl("x509", "-req", "-in", str(work / "broker.csr"), "-CA", str(self.ca_file),
                     "-CAkey", str(self.ca_key), "-set_serial", str(secrets.randbits(63)), "-days", str(CERT_DAYS),
                     "-sha256", "-extfile", str(work / "ext.cnf"), "-out", str(work / "broker.crt"))
            key = (work / "broker.key").read_text()
            write_atomically(self.keystore, key + (work / "broker.crt").read_text() + self.ca_file.read_text(), PRIVATE)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    # --- credentials -------------------------------------------------------------------------------
    def passwords(self) -> dict[str, str]:
        try:
            return dict(json.loads(self.credentials_file.read_text())["users"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SecurityError(f"{self.credentials_file} cannot be read ({type(exc).__name__}); "
                                "`chatpipe down` and delete the state folder's kafka/ to make new users") from None

    def password(self, user: str) -> str:
        passwords = self.passwords()
        if user not in passwords:
            raise SecurityError(f"no SCRAM user {user!r} in {self.credentials_file}")
        return passwords[user]

    def scram_format_args(self) -> list[str]:
        """``StorageTool format`` arguments creating every user (the passwords are URL-safe: no ``,``/``]``)."""
        return [f"--add-scram={MECHANISM}=[name={user},password={password}]"
                for user, password in self.passwords().items()]

    def scrub(self, text: str) -> str:
        """``text`` with every password of this broker replaced (for error messages and logs)."""
        for password in self.passwords().values():
            text = text.replace(password, "***")
        return text

    def client_env(self, user: str) -> dict[str, str]:
        """The ``CHATPIPE_KAFKA_*`` variables (``KafkaSettings``) of a client logging in as ``user``."""
        return {"CHATPIPE_KAFKA_SECURITY_PROTOCOL": PROTOCOL, "CHATPIPE_KAFKA_SASL_MECHANISM": MECHANISM,
                "CHATPIPE_KAFKA_SASL_USERNAME": user,
                "CHATPIPE_KAFKA_SASL_PASSWORD_FILE": str(self.password_file(user)),
                "CHATPIPE_KAFKA_SSL_CA_FILE": str(self.ca_file)}

    def client_config(self, user: str = ADMIN_USER) -> dict[str, str]:
        """librdkafka settings of a client logging in as ``user`` (the broker's own readiness probe)."""
        return {"security.protocol": PROTOCOL, "sasl.mechanism": MECHANISM, "sasl.username": user,
                "sasl.password": self.password(user), "ssl.ca.location": str(self.ca_file)}

    def settings_fields(self, user: str = ADMIN_USER) -> dict[str, str]:
        """``KafkaSettings`` keyword arguments of ``user`` (``security_protocol=...``), for a client in
        this process: the password itself (a ``SecretStr`` there), so that no ``CHATPIPE_KAFKA_SASL_*``
        variable of the environment can take its place."""
        fields = {k.removeprefix("CHATPIPE_KAFKA_").lower(): v for k, v in self.client_env(user).items()}
        del fields["sasl_password_file"]
        return {**fields, "sasl_password": self.password(user)}


# --- ACLs ------------------------------------------------------------------------------------------
# What each principal may do; the StandardAuthorizer denies everything else, and the admin user is
# a super user (the catalog, `chatpipe status`, `chatpipe forget`, a person's shell). Per topic of
# the catalog, from what each service reads and writes (gateway/service.py, inference/
# worker/*, streams/app.py, spark_jobs/); "own" topics are those a service creates itself: the
# gateway's reply topic <prefix>chat.replies.<gateway id>, Faust's <prefix>chatpipe-streams-*
# (changelog, leader topic). The broker's authorizer log (kafka/logs/server.log, "is Denied
# operation") names anything missing; tests/security checks that a whole pipeline run has none.
_READ, _WRITE = ("READ", "DESCRIBE"), ("WRITE", "DESCRIBE")
_OWN = ("READ", "WRITE", "DESCRIBE", "CREATE", "DESCRIBE_CONFIGS")
_STREAMS_APP = "chatpipe-streams"  # StreamsSettings.app_id's default; its internal topics start with it


def _topic_rules(service: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """(pattern type, catalog name or name prefix, operations) of ``service``'s topics."""
    from schemas import topics as t

    read = lambda *names: [("LITERAL", n, _READ) for n in names]
    write = lambda *names: [("LITERAL", n, _WRITE) for n in names]
    replies = ("PREFIXED", t.REPLIES, _WRITE)  # chat.replies and every gateway's chat.replies.<id>
    if service == "gateway":
        return [*write(t.PROMPTS, t.CANCELS, t.FEEDBACK, t.DELETIONS, t.EMBEDDING_REQUESTS),
                *read(t.WORKERS_STATUS),  # the workers' load: admission estimates from it (transport/fleet.py)
                *read(t.MODELS),  # the model versions a request may name (transport/model_catalog.py)
                # the Batch API: batches and their lines' answers (transport/batch_book.py, gateway/batch_runner.py)
                *read(t.BATCHES, t.BATCH_RESULTS), *write(t.BATCHES, t.BATCH_RESULTS),
                # the Responses API's stored responses; erasures reach them (transport/response_store.py)
                *read(t.STORED_RESPONSES, t.DELETIONS), *write(t.STORED_RESPONSES),
                ("PREFIXED", f"{t.REPLIES}.", _OWN)]
    if service == "inference":
        return [*read(t.INFERENCE_REQUESTS, t.INFERENCE_REQUESTS_BATCH, t.CANCELS, t.DELETIONS),
                *write(t.RESPONSES, t.WORKERS_STATUS, t.DELETIONS_AUDIT, t.DLQ), replies,
                # the versions it serves, and FAILED for one it cannot (inference/worker/model_versions.py)
                *read(t.MODELS), *write(t.MODELS)]
    if service == "streams":
        return [*read(t.PROMPTS, t.RESPONSES, t.DELETIONS, t.TURNS, t.FEEDBACK, t.DELETIONS_FANOUT,
                      t.EMBEDDING_REQUESTS),
                *read(t.WORKERS_STATUS),  # intake's deadline estimate for direct prompts (streams/fleet_follower.py)
                *write(t.INFERENCE_REQUESTS, t.INFERENCE_REQUESTS_BATCH, t.TURNS, t.DLQ, t.DELETIONS_FANOUT,
                       t.DELETIONS_AUDIT, t.CANCELS),
                *write(t.RESPONSES),  # the response cache's hits (streams/cache_answers.py)
                # model versions: the choice at intake, the taint of forget, the version agent's stats and rule
                *read(t.MODELS), *write(t.MODELS, t.MODEL_STATS),
                replies, ("PREFIXED", _STREAMS_APP, _OWN)]
    if service == "jobs":  # the Spark jobs read the logged topics; they write files, never to Kafka
        return [("PREFIXED", "chat.", _READ)]
    raise ValueError(f"no service {service!r}")


def service_acls(topic_prefix: str = "") -> list:
    """The ``AclBinding``s of every service user, for the catalog under ``topic_prefix``."""
    from confluent_kafka.admin import (AclBinding, AclOperation, AclPermissionType, ResourcePatternType,
                                       ResourceType)

    def allow(user: str, kind: ResourceType, pattern: str, name: str, operation: str) -> AclBinding:
        return AclBinding(kind, name, ResourcePatternType[pattern], f"User:{user}", "*", AclOperation[operation],
                          AclPermissionType.ALLOW)

    bindings = []
    for service, user in SERVICE_USERS.items():
        for pattern, name, operations in _topic_rules(service):
            bindings += [allow(user, ResourceType.TOPIC, pattern, f"{topic_prefix}{name}", op) for op in operations]
        # Groups: any name (the services' groups are named in several settings classes); a group
        # holds offsets, not data. ALTER_CONFIGS: the worker's share groups (share.auto.offset.reset).
        group_ops = ("READ", "DESCRIBE", "DESCRIBE_CONFIGS", "ALTER_CONFIGS") if service == "inference" \
            else ("READ", "DESCRIBE")
        bindings += [allow(user, ResourceType.GROUP, "LITERAL", "*", op) for op in group_ops]
        bindings.append(allow(user, ResourceType.BROKER, "LITERAL", "kafka-cluster", "DESCRIBE"))
        if service != "jobs":  # idempotent producers
            bindings.append(allow(user, ResourceType.BROKER, "LITERAL", "kafka-cluster", "IDEMPOTENT_WRITE"))
    return list(dict.fromkeys(bindings))  # a topic both read and written: one DESCRIBE (the admin API refuses twice)


def apply_acls(client_config: dict, topic_prefix: str = "", timeout_s: float = 15.0) -> None:
    """Create ``service_acls`` on the broker (as the admin user); an ACL that exists stays as it is."""
    from transport import clients as kafka_clients  # raw: the broker's own admin principal

    admin = kafka_clients.raw_admin({**client_config, "log_level": 0})
    for binding, future in admin.create_acls(service_acls(topic_prefix), request_timeout=timeout_s).items():
        try:
            future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise SecurityError(f"the broker at {client_config.get('bootstrap.servers')} did not answer a CreateAcls "
                                f"request within {timeout_s:.0f} s") from None
        except Exception as exc:  # noqa: BLE001 - KafkaException: names the binding, never a password
            raise SecurityError(f"cannot create the ACL {binding}: {exc}") from None


def make_ca(folder: Path, name: str, days: int = CERT_DAYS) -> Path:
    """A self-signed CA in ``folder`` (``ca.pem``, ``ca.key``); returns the certificate's path.
    Also what a test uses for a CA the broker's certificate does not come from."""
    folder.mkdir(parents=True, exist_ok=True)
    key, cert = folder / "ca.key", folder / "ca.pem"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
             "-days", str(days), "-sha256", "-subj", f"/O=chatpipe/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    os.chmod(key, 0o600)
    return cert


def _openssl(*args: str) -> None:
    if shutil.which("openssl") is None:
        raise SecurityError("openssl not found: `chatpipe up --kafka-security sasl_ssl` makes the broker's CA and "
                            "certificate with it; install openssl")
    proc = subprocess.run(["openssl", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SecurityError(f"openssl {args[0]} failed: {proc.stderr.strip().splitlines()[-1:]}")


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False
