"""What every rendered component shares: names, labels, ``CHATPIPE_*`` variables from the settings
classes, the Kafka connection of a service, volumes, pod and container security.

Variables are never spelt here: :func:`env_var` asks the settings class for the name of a field (its
``env_prefix``, or the first of its ``AliasChoices``, the documented name), and :func:`check_env` refuses a
variable that no settings class of the service reads, so a typo in a values file fails the render
instead of being ignored by the pod. :func:`settings_from_env` builds a service's settings object from
exactly the variables its container gets, which is how the renderer (and the tests) read the ports and
drain times a container will really have.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, TypeVar

from pydantic import AliasChoices
from pydantic_settings import BaseSettings, DotEnvSettingsSource, EnvSettingsSource
from pydantic_settings.sources.utils import parse_env_vars

from k8s.values import Resources, Values, Volume
from schemas.requests import CONTEXT_TOKENS_ENV

PART_OF = "chatpipe"
MANAGED_BY = "chatpipe-k8s-render"
#: Strimzi's internal listeners: plain and TLS (the ports of its examples and its bootstrap Service).
KAFKA_PLAIN_PORT = 9092
KAFKA_TLS_PORT = 9093
KAFKA_USER_MOUNT = "/etc/chatpipe/kafka-user"  # the KafkaUser's Secret (key: password)
KAFKA_CA_MOUNT = "/etc/chatpipe/kafka-ca"  # the cluster CA's Secret (key: ca.crt)


S = TypeVar("S", bound=BaseSettings)


class RenderError(ValueError):
    """Values that cannot make a working deployment (an unknown variable, a bad combination)."""


def name(component: str) -> str:
    return f"{PART_OF}-{component}"


def selector(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": name(component), "app.kubernetes.io/part-of": PART_OF}


def labels(component: str, kind: str = "") -> dict[str, str]:
    return {**selector(component), "app.kubernetes.io/managed-by": MANAGED_BY,
            **({"app.kubernetes.io/component": kind} if kind else {})}


def meta(values: Values, object_name: str, component: str, **extra: Any) -> dict[str, Any]:
    return {"name": object_name, "namespace": values.namespace, "labels": labels(component), **extra}


# --- CHATPIPE_* variables ---------------------------------------------------------------------------
def env_names(cls: type[BaseSettings], field_name: str) -> list[str]:
    """The variables (upper case) that set ``cls.field_name``, the documented one first; a field the class
    lacks is a KeyError."""
    alias = cls.model_fields[field_name].validation_alias
    if isinstance(alias, AliasChoices):
        names = [c for c in alias.choices if isinstance(c, str)]
    elif isinstance(alias, str):
        names = [alias]
    else:
        names = [f"{cls.model_config.get('env_prefix', '')}{field_name}"]
    return [n.upper() for n in names]


def env_var(cls: type[BaseSettings], field_name: str) -> str:
    """The (documented) variable of ``cls.field_name``."""
    return env_names(cls, field_name)[0]


def env_of(cls: type[BaseSettings], **fields: Any) -> dict[str, str]:
    """``{variable: value}`` of ``cls``'s ``fields`` (None left out, a bool as true or false)."""
    return {env_var(cls, k): str(v).lower() if isinstance(v, bool) else str(v)
            for k, v in fields.items() if v is not None}


def check_env(env: Iterable[str], classes: Iterable[type[BaseSettings]], service: str) -> None:
    """Each ``CHATPIPE_*`` variable of ``env`` is read by one of ``classes`` (or is the shared context size)."""
    known = {CONTEXT_TOKENS_ENV, "CHATPIPE_LOG_FORMAT"}
    for cls in classes:
        known |= {n for field_name in cls.model_fields for n in env_names(cls, field_name)}
    unknown = sorted(v for v in env if v.upper().startswith("CHATPIPE_") and v.upper() not in known)
    if unknown:
        raise RenderError(f"{service}: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} read by none of "
                          f"its settings ({', '.join(c.__name__ for c in classes)})")


def settings_from_env(cls: type[S], env: Mapping[str, str], **values: Any) -> S:
    """``cls`` as a container with the variables ``env`` builds it (the CLI adds no flag for these):
    ``values`` (init arguments), then ``env``, then the defaults; the process environment of the
    renderer is never read, so a developer's own ``CHATPIPE_*`` cannot leak into a manifest.

    pydantic-settings reads variables in its ``EnvSettingsSource``s (the class's own, and any it adds in
    ``settings_customise_sources``, e.g. transport.context_settings' shared context size): each gets
    ``env`` as its variables instead of ``os.environ``."""
    mapping = dict(env)

    def customise_sources(sub, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings):
        sources = cls.settings_customise_sources.__func__(sub, settings_cls, init_settings, env_settings,
                                                           dotenv_settings, file_secret_settings)
        for source in sources:
            if isinstance(source, EnvSettingsSource) and not isinstance(source, DotEnvSettingsSource):
                source.env_vars = parse_env_vars(mapping, source.case_sensitive, source.env_ignore_empty,
                                                 source.env_parse_none_str)
        return sources

    # A subclass of the same name (its validation errors name the class) whose sources read ``mapping``.
    from_mapping = type(cls.__name__, (cls,), {"__module__": cls.__module__,
                                               "settings_customise_sources": classmethod(customise_sources)})
    built = from_mapping(**values)
    # The same values as an instance of ``cls`` itself (validated above; nothing is read again).
    return cls.model_construct(_fields_set=built.model_fields_set, **{k: getattr(built, k) for k in cls.model_fields})


def env_list(env: dict[str, str]) -> list[dict[str, Any]]:
    return [{"name": k, "value": v} for k, v in env.items()]


# --- Kafka --------------------------------------------------------------------------------------------
def kafka_user(service: str) -> str:
    """The Strimzi KafkaUser (and SCRAM user) of ``service``: the local secured stack's names."""
    from infra.kafka_security import SERVICE_USERS

    return SERVICE_USERS[service]


def bootstrap_servers(values: Values) -> str:
    port = KAFKA_TLS_PORT if values.security else KAFKA_PLAIN_PORT
    return f"{values.kafka.cluster}-kafka-bootstrap.{values.namespace}.svc:{port}"


def cluster_ca_secret(values: Values) -> str:
    return f"{values.kafka.cluster}-cluster-ca-cert"  # made by Strimzi's cluster operator


def kafka_env(values: Values, service: str) -> dict[str, str]:
    """The ``KafkaSettings`` variables of ``service``: where the brokers are, the prefix, and with
    security its own user (password and CA as mounted files, never as a value)."""
    from schemas.topics import CATALOG, replication_for
    from transport.settings import KafkaSettings

    # Copies of the topics the services create themselves (reply topics, Faust's changelog), as the
    # catalog's rule gives for this cluster (CHATPIPE_REPLICATION_FACTOR).
    replication = replication_for(CATALOG[0], values.kafka.nodes, values.kafka.replication_factor)[0]
    env = env_of(KafkaSettings, bootstrap_servers=bootstrap_servers(values),
                 topic_prefix=values.topic_prefix or None, replication_factor=replication)
    if values.security:
        from infra.kafka_security import MECHANISM, PROTOCOL

        env |= env_of(KafkaSettings, security_protocol=PROTOCOL, sasl_mechanism=MECHANISM,
                      sasl_username=kafka_user(service), sasl_password_file=f"{KAFKA_USER_MOUNT}/password",
                      ssl_ca_file=f"{KAFKA_CA_MOUNT}/ca.crt")
    return env


def kafka_volumes(values: Values, service: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) of ``service``'s Kafka credentials: none without security."""
    if not values.security:
        return [], []
    volumes = [
        {"name": "kafka-user", "secret": {"secretName": kafka_user(service),
                                          "items": [{"key": "password", "path": "password"}]}},
        {"name": "kafka-ca", "secret": {"secretName": cluster_ca_secret(values),
                                        "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
    ]
    mounts = [{"name": "kafka-user", "mountPath": KAFKA_USER_MOUNT, "readOnly": True},
              {"name": "kafka-ca", "mountPath": KAFKA_CA_MOUNT, "readOnly": True}]
    return volumes, mounts


def tracing_env(values: Values) -> dict[str, str]:
    from transport.spans import TracingSettings

    return env_of(TracingSettings, otlp_endpoint=values.otlp_endpoint)


# --- volumes ------------------------------------------------------------------------------------------
def claim_name(volume: Volume, what: str) -> str:
    return volume.claim or name(what)


def volume_source(volume: Volume, what: str, read_only: bool = False) -> dict[str, Any]:
    """The pod volume named ``what`` for ``volume``."""
    if volume.kind == "pvc":
        return {"name": what, "persistentVolumeClaim": {"claimName": claim_name(volume, what),
                                                        **({"readOnly": True} if read_only else {})}}
    if volume.kind == "hostPath":
        if not volume.host_path:
            raise RenderError(f"{what}: kind hostPath needs host_path")
        return {"name": what, "hostPath": {"path": volume.host_path, "type": "DirectoryOrCreate"}}
    return {"name": what, "emptyDir": {}}


def claim(values: Values, volume: Volume, what: str) -> list[dict[str, Any]]:
    """The PersistentVolumeClaim of ``volume`` when it is one to make here."""
    if volume.kind != "pvc" or not volume.create:
        return []
    spec = {"accessModes": [volume.access_mode], "resources": {"requests": {"storage": volume.size}},
            **({"storageClassName": volume.storage_class} if volume.storage_class else {})}
    return [{"apiVersion": "v1", "kind": "PersistentVolumeClaim",
             "metadata": meta(values, claim_name(volume, what), what), "spec": spec}]


# --- pods ---------------------------------------------------------------------------------------------
def resources(r: Resources, extra: dict[str, str] | None = None) -> dict[str, Any]:
    """Requests and limits, each with ``extra`` added (a GPU is asked for in both)."""
    extra = extra or {}
    return {kind: {**amounts, **extra} for kind, amounts in (("requests", r.requests), ("limits", r.limits))
            if amounts or extra}


def container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def scrape_annotations(values: Values, port: int) -> dict[str, str]:
    if not values.prometheus.annotations:
        return {}
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}


def http_probe(path: str, port: str | int, period_s: int, failures: int, timeout_s: int = 3) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period_s, "failureThreshold": failures,
            "timeoutSeconds": timeout_s}


def pod_spec_common(values: Values) -> dict[str, Any]:
    pull_secrets = [{"name": s} for s in values.image_pull_secrets]
    return {"securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            **({"imagePullSecrets": pull_secrets} if pull_secrets else {})}


def pdb(values: Values, component: str) -> dict[str, Any]:
    """At most one pod of ``component`` away at a time for a voluntary disruption (a node drain)."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": meta(values, name(component), component),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(component)}}}
