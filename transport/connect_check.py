"""The first words with the broker at a service's start: credentials and certificate checked, in one line.

A wrong SASL password or a broker certificate the client does not trust is a configuration error,
not an outage: every Kafka client would retry it forever (librdkafka reconnects, Faust restarts its
consumer, the supervisor restarts the process) and log a screen per attempt. :func:`check_connection`
asks the broker for metadata once with an admin client of the service's own settings, watches
librdkafka's errors while it does, and turns the ones that cannot heal into a
:class:`KafkaConnectError` whose message names the broker, the user or the CA file and the cause.
The commands print it and exit :data:`EXIT_CONFIG` (78, ``EX_CONFIG``).

Not here: a broker that does not answer at all. That is an outage, which each service already
rides out its own way (the streams tier's retry budget and code 75, the worker's FAILED
heartbeat); the check then says so (``False``) and the service starts as before.
"""

from __future__ import annotations

import logging
import re
import time

from transport.errors import TransportError
from transport.settings import KafkaSettings

log = logging.getLogger(__name__)

#: Exit code of a service whose Kafka settings the broker refused (sysexits.h ``EX_CONFIG``): a
#: restart cannot help, unlike 75 (``EX_TEMPFAIL``, an outage).
EXIT_CONFIG = 78

# librdkafka prefixes its error strings with the broker it was talking to:
# "sasl_ssl://127.0.0.1:19093/bootstrap: SASL authentication error: ..."
_BROKER = re.compile(r"^(?:[a-z_]+://)?(?P<broker>[^/\s]+)/[^:\s]*:\s*")
# The reason OpenSSL gave, e.g. "certificate verify failed" in
# "SSL handshake failed: error:0A000086:SSL routines::certificate verify failed: broker certificate ..."
_OPENSSL_REASON = re.compile(r"error:[0-9A-Fa-f]+:[^:]*::(?P<reason>[^:]+)")


#: Hang-ups on the first request that make "this listener expects TLS" the explanation.
_HANGUPS = 5


class KafkaConnectError(TransportError):
    """The broker refused this client's credentials, or the TLS handshake failed: fix the settings."""


class _Collect:
    """librdkafka's log lines into ``lines``: a dropped connection's cause is only said there
    (``error_cb`` gets "1/1 brokers are down")."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines

    def log(self, level: int, fmt: str, *args) -> None:
        line = fmt % args if args else fmt
        # "FAIL [chatpipe#producer-1] [thrd:...]: sasl_ssl://host:port/bootstrap: <what happened>"
        self.lines.append(line.split("]: ", 1)[1] if "]: " in line else line)


def check_connection(kafka: KafkaSettings, timeout_s: float = 10.0) -> bool:
    """True once the broker answered a metadata request with these settings.

    Raises :class:`KafkaConnectError` (one line) when it refused the SASL credentials or a TLS
    handshake failed; returns False when no broker answered within ``timeout_s`` for any other
    reason (down, unreachable), leaving that to the service's own outage handling.
    """
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    seen: list[str] = []
    admin = AdminClient({**kafka.client_config(), "logger": _Collect(seen),
                         "error_cb": lambda error: seen.append(error.str()),
                         # reconnect quickly: the few seconds of the check see several attempts, not one
                         "reconnect.backoff.ms": 100, "reconnect.backoff.max.ms": 1000})
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            admin.list_topics(timeout=min(1.0, max(deadline - time.monotonic(), 0.1)))
            log.info("Kafka at %s answered (%s)", kafka.bootstrap_servers, kafka.describe_security())
            return True
        except KafkaException as exc:
            seen.append(exc.args[0].str() if exc.args else str(exc))
        admin.poll(0)  # serves error_cb
        problem = explain(kafka, seen)
        if problem is not None:
            raise KafkaConnectError(problem)
        if time.monotonic() >= deadline or _only_unreachable(seen):
            log.warning("Kafka at %s did not answer (%s): starting anyway, the service retries",
                        kafka.bootstrap_servers, seen[-1] if seen else f"nothing within {timeout_s:.0f} s")
            return False


def explain(kafka: KafkaSettings, errors: list[str]) -> str | None:
    """The one line for the first error in ``errors`` (librdkafka's strings) that retrying cannot
    fix, or None when all of them may be an outage."""
    for error in errors:
        broker, text = _split_broker(error, kafka.bootstrap_servers)
        lower = text.lower()
        if "sasl authentication error" in lower or "authentication failed" in lower:
            return (f"Kafka at {broker} refused the SASL credentials of user {kafka.sasl_username!r} "
                    f"({kafka.sasl_mechanism}): authentication failed")
        if "unsupported sasl mechanism" in lower or "no common sasl mechanism" in lower:
            return (f"Kafka at {broker} does not offer SASL {kafka.sasl_mechanism} on this listener "
                    f"({_detail(text)})")
        if "certificate verify failed" in lower:
            trusted_by = (f"--kafka-ssl-ca-file {kafka.ssl_ca_file}" if kafka.ssl_ca_file is not None
                          else "the system's CA certificates (no --kafka-ssl-ca-file given)")
            return (f"the TLS certificate of Kafka at {broker} is not trusted by {trusted_by} "
                    f"({_openssl_reason(text)})")
        if "ssl handshake failed" in lower or "ssl alert" in lower:
            reason = _openssl_reason(text)
            if "wrong version number" in reason or "packet length too long" in reason:
                return (f"Kafka at {broker} does not speak TLS on this port: is its listener PLAINTEXT or "
                        f"SASL_PLAINTEXT rather than {kafka.security_protocol}? ({reason})")
            return f"the TLS handshake with Kafka at {broker} failed ({reason})"
        if "incorrect security.protocol" in lower or "connecting to a ssl listener" in lower:
            return _expects_tls(kafka, broker)
    # A plaintext client at a TLS listener: the broker hangs up on the first request, every time
    # (once or twice could be a broker going down; the check retries every 0.1-1 s).
    hangups = [e for e in errors if "disconnected" in e.lower() and "apiversion_query" in e.lower()]
    if not kafka.uses_tls and len(hangups) >= _HANGUPS:
        return _expects_tls(kafka, _split_broker(hangups[0], kafka.bootstrap_servers)[0])
    return None


def _only_unreachable(errors: list[str]) -> bool:
    """Every broker was tried and none took a TCP connection (refused, unresolvable): nothing to say
    about the settings, and no reason to wait longer."""
    tried = any("brokers are down" in e for e in errors)
    tcp = ("connect to ", "failed to resolve", "brokers are down", "failed to get metadata")
    return tried and all(any(t in e.lower() for t in tcp) for e in errors)


def _expects_tls(kafka: KafkaSettings, broker: str) -> str:
    return (f"Kafka at {broker} hangs up on the first request: its listener probably expects TLS "
            f"(SSL or SASL_SSL), not {kafka.security_protocol} (--kafka-security-protocol)")


def _split_broker(error: str, default: str) -> tuple[str, str]:
    match = _BROKER.match(error)
    if match is None:
        return default, error
    return match["broker"], error[match.end():]


def _openssl_reason(text: str) -> str:
    match = _OPENSSL_REASON.search(text)
    return _detail(match["reason"]) if match else _detail(text)


def _detail(text: str) -> str:
    return text.split(" (after ")[0].strip()  # librdkafka appends "(after 12ms in state ...)"
