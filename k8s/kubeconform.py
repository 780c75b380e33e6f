"""kubeconform, built once from the Go module proxy, run offline against the vendored schemas.

The binary is built like the stack's Jaeger and Prometheus (``infra.observability.binaries.ensure_program``:
``go get -tool`` in a scratch module, ``go build`` with ``CGO_ENABLED=0``, into a temporary folder renamed
when complete, under a lock) into ``<cache_dir>/bin/kubeconform-<version>/kubeconform``
(``~/.cache/chatpipe/bin/...``), where every later run and every checkout on the machine finds it; the
first build takes seconds. It is then run in strict mode (unknown fields and duplicate keys are errors)
with only local schema locations (``k8s/schemas/``: Kubernetes' kinds and the CRDs of Strimzi, KEDA
and the Spark operator, SOURCES.md says where each comes from), so it never reaches for the network; a
kind without a schema there is an error, not a skip.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from infra.observability.binaries import GoProgram, ensure_program
from infra.settings import StackSettings

KUBECONFORM = GoProgram("kubeconform", "github.com/yannh/kubeconform/cmd/kubeconform", "v0.8.0",
                        "kubeconform 0.8.0", 1)
SCHEMAS = Path(__file__).resolve().parent / "schemas"
#: The Kubernetes release whose OpenAPI spec the kinds' schemas come from.
KUBERNETES_VERSION = "1.35.4"
#: Folders of schemas, in the order kubeconform tries them: Kubernetes' kinds, then each project's CRDs.
LOCATIONS = (f"kubernetes-v{KUBERNETES_VERSION}", "strimzi-1.2.0", "keda-2.20.2", "spark-operator-2.5.2")


@dataclass(frozen=True)
class Result:
    ok: bool
    output: str


def binary(settings: StackSettings | None = None, progress: Callable[[str], None] = lambda m: None) -> Path:
    """kubeconform's path, built first if the cache lacks it (needs Go: ``CHATPIPE_GO`` or ``go`` on PATH)."""
    return ensure_program(settings or StackSettings(), KUBECONFORM, progress)


def validate(files: Iterable[Path], *, progress: Callable[[str], None] = lambda m: None) -> Result:
    """kubeconform -strict over ``files`` with the vendored schemas only."""
    cmd = [str(binary(progress=progress)), "-strict", "-summary", "-output", "text",
           "-kubernetes-version", KUBERNETES_VERSION]
    for folder in LOCATIONS:
        cmd += ["-schema-location", str(SCHEMAS / folder / "{{ .ResourceKind }}{{ .KindSuffix }}.json")]
    cmd += [str(f) for f in files]
    proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    return Result(proc.returncode == 0, (proc.stdout + proc.stderr).strip())
