"""``chatpipe k8s render``: every component's objects, one YAML file each, and a kustomization.

``render(values)`` returns the files (name -> objects) and the notes to print (Secrets to create by hand);
``write`` puts them in a folder (``kubectl apply -k DIR``), ``as_text`` is the stdout form. The same values
always give the same text (no random names, no timestamps), so a rendered folder can live in git and
``kubectl diff -k`` shows what a change of settings or values does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import yaml

from k8s import kafka, keda, services, spark, training
from k8s.common import MANAGED_BY, labels
from k8s.values import Values

#: The order of the files, which is the order of ``kubectl apply -k``'s resources list.
ORDER = ("namespace", "kafka", "secrets", "storage", "qdrant", "redis", "streams", "inference", "gateway", "keda", "spark")
#: Rendered and validated, but not in the kustomization (applied by hand, each apply starts a run).
ON_DEMAND = ("spark-run", "train-run")


@dataclass
class Rendered:
    files: dict[str, list[dict[str, Any]]]
    notes: list[str] = field(default_factory=list)


def render(values: Values) -> Rendered:
    secrets, todo = services.secrets(values)
    files = {
        "namespace": [{"apiVersion": "v1", "kind": "Namespace",
                       "metadata": {"name": values.namespace, "labels": labels("namespace")}}],
        "kafka": kafka.render(values),
        "secrets": secrets,
        **services.render(values),
        "keda": keda.render(values),
        "spark": spark.render(values),
    }
    files = {name: files[name] for name in ORDER if files.get(name)}
    if values.spark.enabled and values.spark.schedule_with == "operator":
        files["spark-run"] = spark.on_demand(values)
    if training.render(values):
        files["train-run"] = training.render(values)
    notes = [f"Secret to create before `kubectl apply -k`: {line}" for line in todo]
    return Rendered(files, notes)


class _Dumper(yaml.SafeDumper):
    """Every object written out in full: no ``&id001`` anchors where the renderer shares a list."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def to_yaml(objects: list[dict[str, Any]]) -> str:
    return "".join("---\n" + yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=120) for obj in objects)


def kustomization(rendered: Rendered) -> dict[str, Any]:
    return {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            # Every object names its namespace already (the services are given DNS names in it).
            "resources": [f"{name}.yaml" for name in rendered.files if name not in ON_DEMAND],
            "labels": [{"pairs": {"app.kubernetes.io/managed-by": MANAGED_BY}, "includeSelectors": False}]}


def header(name: str) -> str:
    note = (" Not in kustomization.yaml: `kubectl create -f` it for one run of each job."
            if name in ON_DEMAND else "")
    return f"# Rendered by `chatpipe k8s render` (k8s/); edit the values or the settings, not this file.{note}\n"


def files_text(rendered: Rendered) -> Iterator[tuple[str, str]]:
    for name, objects in rendered.files.items():
        yield f"{name}.yaml", header(name) + to_yaml(objects)
    yield "kustomization.yaml", header("kustomization") + yaml.safe_dump(kustomization(rendered), sort_keys=False)


def write(rendered: Rendered, out: Path) -> list[Path]:
    """The files in ``out`` (created); the Secrets file is readable by its owner only. Files of an earlier
    render that this one no longer makes are removed (so that ``apply -k`` and kubeconform see this one)."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for file_name, text in files_text(rendered):
        path = out / file_name
        tmp = path.with_name(f".{file_name}.tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if file_name == "secrets.yaml" else 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        tmp.replace(path)
        written.append(path)
    for stale in set(ORDER + ON_DEMAND) - {p.stem for p in written}:
        (out / f"{stale}.yaml").unlink(missing_ok=True)
    return written


def as_text(rendered: Rendered) -> str:
    return "".join(f"# file: {name}\n{text}" for name, text in files_text(rendered))
