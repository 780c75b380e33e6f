"""The whole stack on a secured broker: ``chatpipe up --kafka-security sasl_ssl`` in a temporary state
folder, once for the module (about 20 s on 2 cores after the first model load), ``chatpipe down`` at
the end, also when a test or the start failed.

The broker's client port is SASL_SSL (SCRAM-SHA-512 over TLS); its CA, certificate and the users of
the services are made by ``chatpipe up`` itself (``infra.kafka_security``), so the test sees what a
user sees. Memory is Qdrant local mode in the state folder (no server needed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from chatpipe.testing.ports import free_port
from infra.kafka_security import BrokerSecurity
from tests.faults.stack import SERVICE_ENV, cli


@dataclass
class SecuredStack:
    state: Path
    kafka_port: int
    gateway_port: int
    up_output: str

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.kafka_port}"

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def api_key(self) -> str:
        return next(iter(json.loads((self.state / "gateway" / "keys.json").read_text())))

    @property
    def security(self) -> BrokerSecurity:
        return BrokerSecurity(self.state / "kafka" / "security")

    def kafka_settings(self, user: str, **overrides):
        """``KafkaSettings`` of a client logging in as ``user`` (the stack's own credentials)."""
        from transport.settings import KafkaSettings

        return KafkaSettings(bootstrap_servers=self.bootstrap,
                             **{**self.security.settings_fields(user), **overrides})

    def env(self, user: str, **overrides: str) -> dict[str, str]:
        """The ``CHATPIPE_KAFKA_*`` variables of ``user`` (what its ``<user>.env`` file holds)."""
        return {**self.security.client_env(user), "CHATPIPE_BOOTSTRAP_SERVERS": self.bootstrap, **overrides}


@pytest.fixture(scope="module")
def secured_stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("secured")
    state = root / "state"
    kafka_port, gateway_port = free_port(), free_port()
    flags = ["--state-dir", str(state), "--kafka-port", str(kafka_port), "--controller-port", str(free_port()),
             "--gateway-port", str(gateway_port), "--worker-metrics-port", str(free_port()),
             "--streams-metrics-port", str(free_port()), "--redis-port", str(free_port())]
    try:
        up = cli("up", *flags, "--kafka-security", "sasl_ssl", timeout=600, env=SERVICE_ENV)
        assert up.returncode == 0, f"chatpipe up failed:\n{up.stdout}\n{up.stderr}"
        yield SecuredStack(state, kafka_port, gateway_port, up.stdout + up.stderr)
    finally:
        down = cli("down", "--state-dir", str(state), timeout=300)
        assert down.returncode == 0, down.stdout + down.stderr
