"""Settings of the Kafka adapters, shared by every component that talks to the broker.

One ``KafkaSettings`` says where the broker is and how to reach it securely; each client library
gets its own translation of it: :meth:`KafkaSettings.client_config` (librdkafka: the gateway, the
worker, the admin client, every transport class), :meth:`KafkaSettings.faust_broker_credentials`
(Faust/aiokafka: the streams tier) and :meth:`KafkaSettings.spark_kafka_options` (the Java client
inside Spark's Kafka source). docs/security.md lists what each library supports.

Secrets (``sasl_password``, ``ssl_key_password``) are ``SecretStr``: the settings' repr, error
lines and ``chatpipe status`` show ``**********``. The dicts these methods return hold them in
clear (the libraries need them): pass them to the client, never to a log line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, SettingsConfigDict

SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"]

# How long a fetch that finds nothing waits at the broker (librdkafka's fetch.wait.max.ms), for every
# consumer that waits for records to come: the broker answers a waiting fetch as soon as a record is
# appended (fetch.min.bytes 1), so this bounds only an idle fetch and costs no latency
# (bench/kafka_hop.py); an idle consumer sends 1000 / this fetches a second and the broker serves them all.
IDLE_FETCH_WAIT_MS = 500

SASL_PROTOCOLS = ("SASL_PLAINTEXT", "SASL_SSL")
TLS_PROTOCOLS = ("SSL", "SASL_SSL")
#: librdkafka properties whose value is a secret (masked by :func:`redacted`).
SECRET_PROPERTIES = frozenset({"sasl.password", "ssl.key.password", "sasl.oauthbearer.client.secret",
                               "kafka.sasl.jaas.config", "kafka.ssl.key.password", "kafka.ssl.keystore.key"})
#: The Java client's login module of each mechanism (Spark's Kafka source).
_JAAS_MODULES = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "OAUTHBEARER": "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule",
}


def _env(name: str) -> AliasChoices:
    """Field ``name`` from ``CHATPIPE_KAFKA_<NAME>`` (the documented variable) or ``CHATPIPE_<NAME>``
    (the class's prefix, like every other field); by name in code (``populate_by_name``)."""
    return AliasChoices(f"CHATPIPE_KAFKA_{name.upper()}", f"CHATPIPE_{name.upper()}")


def _config_error(message: str) -> PydanticCustomError:
    # A custom error keeps the line as written (a ValueError would read "Value error, ...").
    return PydanticCustomError("kafka_security", message)


def redacted(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with every secret value replaced by ``**********``: the only form fit for a log line."""
    return {k: ("**********" if k in SECRET_PROPERTIES and v else v) for k, v in config.items()}


class KafkaSettings(BaseSettings):
    """Where the broker is, how topics are named and how a client proves who it is.

    Built once by the CLI from flags and ``CHATPIPE_*`` environment variables
    (``CHATPIPE_BOOTSTRAP_SERVERS``, ``CHATPIPE_TOPIC_PREFIX``, ``CHATPIPE_KAFKA_SECURITY_PROTOCOL``,
    ...), then passed explicitly. A combination no client could use (SASL without credentials, a
    certificate without its key, a file that is not there) fails here, in one line.
    """

    model_config = SettingsConfigDict(env_prefix="CHATPIPE_", frozen=True, extra="forbid", populate_by_name=True,
                                      hide_input_in_errors=True)  # a rejected input may hold a secret

    bootstrap_servers: str = Field("127.0.0.1:9092", description="Kafka bootstrap servers, host:port[,host:port]")
    topic_prefix: str = Field("", description="Put in front of every catalog topic name, e.g. 'staging.'")
    client_id: str = Field("chatpipe", description="Kafka client.id, shows up in broker logs and metrics")
    # Linger, batch and poll sizes are each service's own settings (the worker's chunk_linger_ms and
    # poll_timeout_s, ...): what suits token chunks does not suit an archive batch.
    replication_factor: int = Field(1, ge=1, description="Replication factor of topics created by `topics apply`")
    delivery_timeout_s: float = Field(30.0, gt=0, description="A record the broker has not acknowledged by then "
                                      "fails (the services' producers; the gateway has its own, shorter one)")

    # --- security (docs/security.md) ---
    security_protocol: SecurityProtocol = Field(
        "PLAINTEXT", validation_alias=_env("security_protocol"),
        description="PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL (any case)")
    sasl_mechanism: SaslMechanism | None = Field(
        None, validation_alias=_env("sasl_mechanism"),
        description="PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or OAUTHBEARER (required with SASL_*)")
    sasl_username: str | None = Field(
        None, validation_alias=_env("sasl_username"),
        description="SASL user (OAUTHBEARER: the OIDC client id)")
    sasl_password: SecretStr | None = Field(
        None, validation_alias=_env("sasl_password"),
        description="SASL password (OAUTHBEARER: the OIDC client secret); environment or file only, never a flag")
    sasl_password_file: Path | None = Field(
        None, validation_alias=_env("sasl_password_file"),
        description="File holding the SASL password (e.g. a mounted secret), read when a client is built")
    sasl_oauth_token_url: str | None = Field(
        None, validation_alias=_env("sasl_oauth_token_url"),
        description="OAUTHBEARER: the OIDC token endpoint (client-credentials grant)")
    sasl_oauth_scope: str | None = Field(
        None, validation_alias=_env("sasl_oauth_scope"), description="OAUTHBEARER: scope asked for, if any")
    ssl_ca_file: Path | None = Field(
        None, validation_alias=_env("ssl_ca_file"),
        description="PEM file of the CA(s) that signed the broker's certificate (default: the system's)")
    ssl_cert_file: Path | None = Field(
        None, validation_alias=_env("ssl_cert_file"), description="PEM client certificate (mutual TLS)")
    ssl_key_file: Path | None = Field(
        None, validation_alias=_env("ssl_key_file"), description="PEM private key of the client certificate")
    ssl_key_password: SecretStr | None = Field(
        None, validation_alias=_env("ssl_key_password"), description="Password of an encrypted ssl_key_file")
    ssl_check_hostname: bool = Field(
        True, validation_alias=_env("ssl_check_hostname"),
        description="Check that the broker's certificate names the host connected to")

    @field_validator("security_protocol", mode="before")
    @classmethod
    def _protocol_any_case(cls, value: Any) -> Any:
        return value.strip().upper() if isinstance(value, str) else value

    @field_validator("sasl_mechanism", mode="before")
    @classmethod
    def _mechanism_any_case(cls, value: Any) -> Any:
        if isinstance(value, str):
            return value.strip().upper().replace("_", "-") or None
        return value

    @model_validator(mode="after")
    def _usable_combination(self) -> KafkaSettings:
        protocol, mechanism = self.security_protocol, self.sasl_mechanism
        has_password = self.sasl_password is not None or self.sasl_password_file is not None
        if protocol in SASL_PROTOCOLS:
            if mechanism is None:
                raise _config_error(f"security_protocol {protocol} needs a sasl_mechanism "
                                    "(PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or OAUTHBEARER)")
            if not self.sasl_username or not has_password:
                who = "an OIDC client id (sasl_username) and secret" if mechanism == "OAUTHBEARER" else \
                    "a sasl_username and"
                raise _config_error(f"SASL {mechanism} needs {who} a sasl_password "
                                    "(CHATPIPE_KAFKA_SASL_PASSWORD or CHATPIPE_KAFKA_SASL_PASSWORD_FILE)")
            if mechanism == "OAUTHBEARER" and not self.sasl_oauth_token_url:
                raise _config_error("SASL OAUTHBEARER needs sasl_oauth_token_url (the OIDC token endpoint)")
        for names, protocols, kind in (
                (("sasl_mechanism", "sasl_username", "sasl_password", "sasl_password_file", "sasl_oauth_token_url"),
                 SASL_PROTOCOLS, "SASL settings are used only with SASL_PLAINTEXT or SASL_SSL"),
                (("ssl_ca_file", "ssl_cert_file", "ssl_key_file", "ssl_key_password"), TLS_PROTOCOLS,
                 "TLS settings are used only with SSL or SASL_SSL")):
            given = [name for name in names if getattr(self, name) is not None]
            if given and protocol not in protocols:
                raise _config_error(f"{given[0]} is set but security_protocol is {protocol}: {kind}")
        if (self.ssl_cert_file is None) != (self.ssl_key_file is None):
            raise _config_error("ssl_cert_file and ssl_key_file go together: a client certificate needs its "
                                "private key and a key its certificate")
        if self.ssl_key_password is not None and self.ssl_key_file is None:
            raise _config_error("ssl_key_password is set without an ssl_key_file")
        for name in ("ssl_ca_file", "ssl_cert_file", "ssl_key_file", "sasl_password_file"):
            path = getattr(self, name)
            if path is not None and not path.is_file():
                raise _config_error(f"{name} {path} is not a readable file")
        return self

    # --- names ---

    def topic(self, name: str) -> str:
        """The real topic name of catalog topic ``name`` under this deployment's prefix."""
        return f"{self.topic_prefix}{name}"

    @property
    def uses_sasl(self) -> bool:
        return self.security_protocol in SASL_PROTOCOLS

    @property
    def uses_tls(self) -> bool:
        return self.security_protocol in TLS_PROTOCOLS

    def sasl_secret(self) -> str | None:
        """The SASL password in clear: ``sasl_password``, else the first line of ``sasl_password_file``
        (read now, so a rotated secret file is picked up by the next client built)."""
        if self.sasl_password is not None:
            return self.sasl_password.get_secret_value()
        if self.sasl_password_file is not None:
            return self.sasl_password_file.read_text(encoding="utf-8").rstrip("\r\n")
        return None

    def describe_security(self) -> str:
        """One line for logs and ``status``: protocol, mechanism, user and files, never a secret."""
        parts = [self.security_protocol]
        if self.uses_sasl:
            parts.append(f"{self.sasl_mechanism} as {self.sasl_username!r}")
        if self.ssl_ca_file is not None:
            parts.append(f"CA {self.ssl_ca_file}")
        if self.ssl_cert_file is not None:
            parts.append(f"client certificate {self.ssl_cert_file}")
        return ", ".join(parts)

    # --- librdkafka (confluent-kafka) ---

    def client_config(self) -> dict[str, str | int | float | bool]:
        """librdkafka settings common to producers, consumers and the admin client.

        Holds the SASL password and key password in clear when they are set: log
        ``redacted(config)``, never the dict itself.
        """
        config: dict[str, str | int | float | bool] = {"bootstrap.servers": self.bootstrap_servers,
                                                        "client.id": self.client_id}
        if self.security_protocol == "PLAINTEXT":
            return config
        config["security.protocol"] = self.security_protocol.lower()
        if self.uses_sasl:
            config["sasl.mechanisms"] = self.sasl_mechanism
            if self.sasl_mechanism == "OAUTHBEARER":
                # librdkafka fetches and refreshes the token itself (client-credentials grant).
                config.update({"sasl.oauthbearer.method": "oidc",
                               "sasl.oauthbearer.client.id": self.sasl_username,
                               "sasl.oauthbearer.client.secret": self.sasl_secret(),
                               "sasl.oauthbearer.token.endpoint.url": self.sasl_oauth_token_url})
                if self.sasl_oauth_scope:
                    config["sasl.oauthbearer.scope"] = self.sasl_oauth_scope
            else:
                config["sasl.username"] = self.sasl_username
                config["sasl.password"] = self.sasl_secret()
        if self.uses_tls:
            if self.ssl_ca_file is not None:
                config["ssl.ca.location"] = str(self.ssl_ca_file)
            if self.ssl_cert_file is not None:
                config["ssl.certificate.location"] = str(self.ssl_cert_file)
                config["ssl.key.location"] = str(self.ssl_key_file)
            if self.ssl_key_password is not None:
                config["ssl.key.password"] = self.ssl_key_password.get_secret_value()
            config["ssl.endpoint.identification.algorithm"] = "https" if self.ssl_check_hostname else "none"
        return config

    # --- Faust / aiokafka ---

    def ssl_context(self):
        """The ``ssl.SSLContext`` the asyncio clients (aiokafka) connect with; None without TLS."""
        if not self.uses_tls:
            return None
        import ssl

        context = ssl.create_default_context(
            ssl.Purpose.SERVER_AUTH, cafile=str(self.ssl_ca_file) if self.ssl_ca_file is not None else None)
        context.check_hostname = self.ssl_check_hostname
        if self.ssl_cert_file is not None:
            password = self.ssl_key_password.get_secret_value() if self.ssl_key_password is not None else None
            context.load_cert_chain(str(self.ssl_cert_file), str(self.ssl_key_file), password=password)
        return context

    def faust_broker_credentials(self):
        """Faust's ``broker_credentials`` (None for PLAINTEXT): its producer, consumers and the admin
        requests that create the changelog all connect with them (faust/transport/drivers/aiokafka.py
        ``credentials_to_aiokafka_auth``)."""
        if self.security_protocol == "PLAINTEXT":
            return None
        import faust

        if not self.uses_sasl:
            return faust.SSLCredentials(self.ssl_context())
        if self.sasl_mechanism == "OAUTHBEARER":
            from transport.oauth import OidcTokenProvider

            return faust.OAuthCredentials(oauth_cb=OidcTokenProvider(self), ssl_context=self.ssl_context())
        # SCRAM-SHA-256/512 and PLAIN: aiokafka implements all three.
        return faust.SASLCredentials(username=self.sasl_username, password=self.sasl_secret(),
                                     mechanism=self.sasl_mechanism, ssl_context=self.ssl_context())

    # --- Spark's Kafka source (the Java client) ---

    def spark_kafka_options(self) -> dict[str, str]:
        """Options of ``spark.read.format("kafka")``: the servers and the Java client's security settings.

        ``kafka.sasl.jaas.config`` holds the password and ``kafka.ssl.keystore.key`` the private key:
        never log these options (``redacted`` them). Files are read by each executor's JVM: on a
        cluster the CA file must be at the same path on every machine.
        """
        options = {"kafka.bootstrap.servers": self.bootstrap_servers}
        if self.security_protocol == "PLAINTEXT":
            return options
        options["kafka.security.protocol"] = self.security_protocol
        if self.uses_sasl:
            options["kafka.sasl.mechanism"] = self.sasl_mechanism
            module = _JAAS_MODULES[self.sasl_mechanism]
            if self.sasl_mechanism == "OAUTHBEARER":
                fields = {"clientId": self.sasl_username, "clientSecret": self.sasl_secret()}
                if self.sasl_oauth_scope:
                    fields["scope"] = self.sasl_oauth_scope
                options["kafka.sasl.oauthbearer.token.endpoint.url"] = self.sasl_oauth_token_url
                options["kafka.sasl.login.callback.handler.class"] = \
                    "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginCallbackHandler"
            else:
                fields = {"username": self.sasl_username, "password": self.sasl_secret()}
            options["kafka.sasl.jaas.config"] = _jaas(module, fields)
        if self.uses_tls:
            if self.ssl_ca_file is not None:
                # PEM truststores need Kafka clients >= 2.7 (KIP-651); Spark 4 ships 3.x.
                options["kafka.ssl.truststore.type"] = "PEM"
                options["kafka.ssl.truststore.location"] = str(self.ssl_ca_file)
            if self.ssl_cert_file is not None:
                # A PEM keystore *file* must hold key and chain together; given as two files, both go
                # in as text. The Java client reads PKCS#8 keys only (BEGIN [ENCRYPTED] PRIVATE KEY).
                options["kafka.ssl.keystore.type"] = "PEM"
                options["kafka.ssl.keystore.certificate.chain"] = self.ssl_cert_file.read_text(encoding="utf-8")
                options["kafka.ssl.keystore.key"] = self.ssl_key_file.read_text(encoding="utf-8")
                if self.ssl_key_password is not None:
                    options["kafka.ssl.key.password"] = self.ssl_key_password.get_secret_value()
            options["kafka.ssl.endpoint.identification.algorithm"] = "https" if self.ssl_check_hostname else ""
        return options


def _jaas(module: str, fields: dict[str, str | None]) -> str:
    """A JAAS line ``<module> required k="v" ...;`` with ``\\`` and ``"`` escaped in the values."""
    quoted = " ".join(f'{k}="{(v or "").replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                      for k, v in fields.items())
    return f"{module} required {quoted};"
