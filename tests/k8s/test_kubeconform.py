"""The rendered manifests pass kubeconform in strict mode against the vendored schemas: Kubernetes' kinds
and the CRDs of Strimzi, KEDA and the Spark operator (k8s/schemas/, no network).

Needs Go (marker ``go``): kubeconform is built once from the Go module proxy into
``~/.cache/chatpipe/bin/kubeconform-<version>/`` (seconds; every later run finds it there). Without Go
the test fails, saying so: it is never skipped.
"""

from __future__ import annotations

import json
import re

import pytest
import yaml

from k8s.kubeconform import LOCATIONS, SCHEMAS, validate
from k8s.render import render, write
from k8s.values import Values

pytestmark = pytest.mark.go


@pytest.fixture(scope="module")
def secret_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("secrets")
    (folder / "keys.json").write_text(json.dumps({"sk-test": {"tenant": "acme"}}))
    (folder / "qdrant.key").write_text("a-qdrant-key\n")
    return folder / "keys.json", folder / "qdrant.key"


def _variants(secret_files) -> dict[str, Values]:
    keys, qkey = secret_files
    return {
        "defaults": Values(),
        "secured-share-cluster": Values.model_validate({
            "namespace": "prod", "topic_prefix": "prod.", "security": True,
            "kafka": {"nodes": 5, "controllers": 3, "storage_class": "fast"},
            "gateway": {"keys_file": str(keys), "hpa": {"metric": "pending"}, "service_type": "LoadBalancer"},
            "inference": {"intake": "share", "gpus": 2}, "qdrant": {"api_key_file": str(qkey), "replicas": 3},
            "model": {"volume": {"kind": "hostPath", "host_path": "/var/lib/models"}},
            "spark": {"source": "archive", "jars": ["local:///opt/jars/a.jar"]},
            "redis": {"enabled": False, "url": "rediss://cache.example:6380/0", "password_secret": "chatpipe-redis"},
            "otlp_endpoint": "http://otel:4318", "image_pull_secrets": ["registry"]}),
        "small-cpu-cronjob": Values.model_validate({
            "kafka": {"nodes": 1}, "streams": {"replicas": 1}, "inference": {"gpus": 0, "keda": {"enabled": False}},
            "gateway": {"hpa": {"enabled": False}}, "model": {"volume": {"kind": "emptyDir"}},
            "qdrant": {"enabled": False, "url": "http://qdrant.example:6333"},
            "spark": {"schedule_with": "cronjob"}, "prometheus": {"annotations": False},
            "redis": {"maxmemory": "1gb", "maxmemory_policy": "allkeys-lfu",
                      "resources": {"requests": {"memory": "1200Mi"}, "limits": {"memory": "1500Mi"}}}}),
    }


@pytest.mark.parametrize("variant", ["defaults", "secured-share-cluster", "small-cpu-cronjob"])
def test_rendered_manifests_pass_kubeconform_strict(variant, secret_files, tmp_path):
    values = _variants(secret_files)[variant]
    rendered = render(values)
    files = [p for p in write(rendered, tmp_path) if p.name != "kustomization.yaml"]
    result = validate(files)
    assert result.ok, result.output
    count = sum(len(objects) for objects in rendered.files.values())
    # Every object was validated against a schema: none skipped, none without one.
    assert re.search(rf"{count} resources found in {len(files)} files - Valid: {count}, Invalid: 0, Errors: 0, "
                     r"Skipped: 0", result.output), result.output


def test_strict_mode_refuses_an_unknown_field_in_each_kind(secret_files, tmp_path):
    """The schemas are strict (closed objects), so a misspelt field of every kind rendered fails."""
    values = _variants(secret_files)["secured-share-cluster"]
    objects = [obj for objs in render(values).files.values() for obj in objs]
    kinds = {}
    for obj in objects:
        kinds.setdefault(obj["kind"], obj)
    broken = []
    for kind, obj in kinds.items():
        obj = json.loads(json.dumps(obj))
        (obj.get("spec") if isinstance(obj.get("spec"), dict) else obj)["specTypo"] = 1
        broken.append(obj)
    path = tmp_path / "broken.yaml"
    path.write_text("".join("---\n" + yaml.safe_dump(o) for o in broken))
    result = validate([path])
    assert not result.ok
    assert re.search(rf"Valid: 0, Invalid: {len(kinds)}, Errors: 0", result.output), result.output


def test_every_vendored_schema_says_where_it_came_from():
    sources = (SCHEMAS / "SOURCES.md").read_text()
    for folder in LOCATIONS:
        files = sorted((SCHEMAS / folder).glob("*.json"))
        assert files, folder
        assert f"`{folder}/`" in sources, folder
        for schema in files:
            assert schema.name in sources, schema
            json.loads(schema.read_text())
