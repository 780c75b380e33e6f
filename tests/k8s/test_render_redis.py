"""`chatpipe k8s render`'s Redis (the streams workers' response cache): a Deployment + Service run as a cache
with the local stack's limits, the streams workers pointed at it; or an external Redis / Valkey (TLS, a
password from a Secret), or none. No cluster, no network (tests/k8s/test_kubeconform.py validates the YAML)."""

from __future__ import annotations

import pytest

from infra.settings import StackSettings
from k8s.render import ORDER, render
from k8s.values import Values
from streams.cache_settings import CacheSettings


def _objects(values: Values, kind: str, name: str) -> list[dict]:
    return [o for objs in render(values).files.values() for o in objs
            if o["kind"] == kind and o["metadata"]["name"] == name]


def _streams_env(values: Values) -> dict[str, dict]:
    (deployment,) = _objects(values, "Deployment", "chatpipe-streams")
    return {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_redis_is_rendered_as_a_cache_with_the_local_stacks_limits_and_the_workers_use_it(monkeypatch):
    values = Values()
    rendered = render(values)
    assert "redis" in rendered.files and ORDER.index("redis") < ORDER.index("streams")
    (deployment,) = _objects(values, "Deployment", "chatpipe-redis")
    (service,) = _objects(values, "Service", "chatpipe-redis")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert deployment["spec"]["replicas"] == 1  # a second pod would be a second, separate cache
    assert container["image"] == values.redis.image and container["command"] == ["redis-server"]
    args = container["args"]
    stack = StackSettings.model_fields
    assert _arg(args, "--maxmemory") == stack["redis_maxmemory"].default == "256mb"
    assert _arg(args, "--maxmemory-policy") == stack["redis_maxmemory_policy"].default == "allkeys-lru"
    assert _arg(args, "--save") == "" and _arg(args, "--appendonly") == "no"  # no persistence
    port = service["spec"]["ports"][0]["port"]
    assert _arg(args, "--port") == str(port) and container["ports"][0]["containerPort"] == port
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert pod["securityContext"]["runAsNonRoot"] and container["securityContext"]["readOnlyRootFilesystem"]
    assert {m["mountPath"] for m in container["volumeMounts"]} == {_arg(args, "--dir")}
    assert "redis-cli" in " ".join(container["readinessProbe"]["exec"]["command"])

    env = _streams_env(values)
    url = f"redis://chatpipe-redis.{values.namespace}.svc:{port}/0"
    assert env["CHATPIPE_CACHE_URL"]["value"] == url and "CHATPIPE_CACHE_PASSWORD" not in env
    for key in [k for k in __import__("os").environ if k.startswith("CHATPIPE_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("CHATPIPE_CACHE_URL", env["CHATPIPE_CACHE_URL"]["value"])
    assert CacheSettings().url == url  # the variable the cache's own settings read


def test_limits_from_the_values(monkeypatch):
    values = Values.model_validate({"namespace": "prod", "redis": {"maxmemory": "2gb",
                                                                    "maxmemory_policy": "allkeys-lfu"}})
    (deployment,) = _objects(values, "Deployment", "chatpipe-redis")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert (_arg(args, "--maxmemory"), _arg(args, "--maxmemory-policy")) == ("2gb", "allkeys-lfu")
    assert _streams_env(values)["CHATPIPE_CACHE_URL"]["value"] == "redis://chatpipe-redis.prod.svc:6379/0"


def test_an_external_redis_with_tls_and_a_password_from_a_secret():
    values = Values.model_validate({"redis": {"enabled": False, "url": "rediss://cache.example:6380/0",
                                              "password_secret": "chatpipe-redis"}})
    rendered = render(values)
    assert "redis" not in rendered.files and not _objects(values, "Deployment", "chatpipe-redis")
    env = _streams_env(values)
    assert env["CHATPIPE_CACHE_URL"]["value"] == "rediss://cache.example:6380/0"
    assert env["CHATPIPE_CACHE_PASSWORD"] == {"name": "CHATPIPE_CACHE_PASSWORD", "valueFrom": {
        "secretKeyRef": {"name": "chatpipe-redis", "key": "password"}}}  # never a value in the manifest
    assert any("create secret generic chatpipe-redis --from-literal=password=" in n for n in rendered.notes)


def test_no_redis_and_no_url_is_no_cache():
    values = Values.model_validate({"redis": {"enabled": False}})
    assert "redis" not in render(values).files
    env = _streams_env(values)
    assert "CHATPIPE_CACHE_URL" not in env and "CHATPIPE_CACHE_PASSWORD" not in env


@pytest.mark.parametrize("redis, error", [
    ({"url": "redis://elsewhere:6379/0"}, "redis.enabled is true"),
    ({"enabled": False, "url": "http://cache:6379"}, "a redis:// or rediss://"),
    ({"enabled": False, "password_secret": "s"}, "redis.password_secret needs redis.url"),
])
def test_values_that_cannot_work_are_refused(redis, error):
    with pytest.raises(ValueError, match=error):
        Values.model_validate({"redis": redis})
