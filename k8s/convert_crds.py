"""Make the JSON schemas kubeconform validates the rendered manifests against (``k8s/schemas/``).

Two inputs, one output layout (kubeconform's ``{{ .ResourceKind }}{{ .KindSuffix }}.json``:
``{kind}-{group}-{version}.json``, lowercased, the group cut at its first dot, ``{kind}-{version}.json``
for the core group):

- ``crd FILE...``: CustomResourceDefinitions as the operator projects publish them (Strimzi, KEDA, the
  Spark operator): each served version's ``openAPIV3Schema`` becomes one file, like kubeconform's own
  ``scripts/openapi2jsonschema.py`` does;
- ``kubernetes SWAGGER --kind Kind.group/version ...``: Kubernetes' own kinds from the OpenAPI v2 spec in
  the ``k8s.io/kubernetes`` Go module (``api/openapi-spec/swagger.json``), each made stand-alone (every
  ``$ref`` expanded in place), like openapi2jsonschema's ``--kubernetes --stand-alone --strict`` (the
  schemas of github.com/yannh/kubernetes-json-schema, which kubeconform downloads by default).

"Strict", as openapi2jsonschema makes it: every object schema that lists ``properties`` gets
``additionalProperties: false`` (an unknown or misspelt field is an error, as the API server's strict
field validation makes it), except where the schema keeps unknown fields
(``x-kubernetes-preserve-unknown-fields``) and in the branches of ``anyOf`` / ``oneOf`` / ``allOf`` (a
branch sees the whole object: closing it would refuse every field the other branches name; upstream's
script closes them too, which is why it is not reused as is). Also as upstream: ``int-or-string`` becomes
``oneOf: [string, integer]``; Kubernetes' ``Quantity`` (a string in the spec) takes a number too, as the
API server does. Beyond upstream: the root is closed too (``DENY_ROOT_ADDITIONAL_PROPERTIES``), ``kind``
and ``apiVersion`` are pinned with an ``enum``, OpenAPI's ``nullable: true`` becomes a ``null`` type, and
what only documents a schema (``description``, ``example``, the ``x-kubernetes-*`` list and patch
annotations) is dropped, which keeps the vendored files small. CEL rules (``x-kubernetes-validations``)
cannot be checked by a JSON-schema validator and are dropped as well; a server-side dry run checks them
(docs/deploy.md "Kubernetes").

Run by hand when a pinned version changes (k8s/schemas/SOURCES.md says where each input came from);
needs PyYAML only.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any, Iterable

import yaml

#: Keys of a schema that say nothing a validator checks.
DROPPED = {"description", "example", "externalDocs", "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
           "x-kubernetes-map-type", "x-kubernetes-patch-strategy", "x-kubernetes-patch-merge-key",
           "x-kubernetes-unions", "x-kubernetes-group-version-kind", "x-kubernetes-validations",
           "x-kubernetes-embedded-resource", "x-kubernetes-action", "x-kubernetes-associated"}
#: Keys whose value maps names to schemas (the names are data, not schema keywords).
SCHEMA_MAPS = ("properties", "patternProperties", "definitions", "dependencies")
#: Keys whose value is a list of schemas whose branches must stay open.
BRANCHES = ("anyOf", "oneOf", "allOf")
INT_OR_STRING = {"oneOf": [{"type": "string"}, {"type": "integer"}]}
QUANTITY = {"oneOf": [{"type": "string"}, {"type": "number"}]}
QUANTITY_REF = "#/definitions/io.k8s.apimachinery.pkg.api.resource.Quantity"


def file_name(kind: str, group: str, version: str) -> str:
    """kubeconform's name for a kind's schema: ``{kind}{KindSuffix}.json`` (pkg/registry/registry.go)."""
    suffix = f"-{group.split('.')[0]}" if group else ""
    return f"{kind}{suffix}-{version}.json".lower()


def strict(schema: Any, *, close: bool = True) -> Any:
    """A copy of ``schema`` made strict and free of annotations (see the module's docstring)."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in DROPPED:
            continue
        if key in SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: strict(sub) for name, sub in value.items()}
        elif key in BRANCHES and isinstance(value, list):
            out[key] = [strict(sub, close=False) for sub in value]
        elif key in ("items", "additionalProperties", "not") and isinstance(value, (dict, list)):
            out[key] = strict(value, close=key != "not")
        else:
            out[key] = value
    if out.get("format") == "int-or-string" or out.pop("x-kubernetes-int-or-string", False):
        if not any(k in out for k in BRANCHES):
            return {**{k: v for k, v in out.items() if k not in ("type", "format")}, **INT_OR_STRING}
        out.pop("format", None)
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"] if isinstance(out["type"], str) else [*out["type"], "null"]
    keeps_unknown = out.get("x-kubernetes-preserve-unknown-fields") is True
    if close and "properties" in out and "additionalProperties" not in out and not keeps_unknown:
        out["additionalProperties"] = False
    return out


def pin_kind(schema: dict[str, Any], kind: str, api_version: str) -> dict[str, Any]:
    """``kind`` and ``apiVersion`` of the root allow this kind's values only."""
    props = schema.setdefault("properties", {})
    props["kind"] = {"type": "string", "enum": [kind]}
    props["apiVersion"] = {"type": "string", "enum": [api_version]}
    return schema


# --- CRDs ------------------------------------------------------------------------------------------
def crd_schemas(documents: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """File name -> schema of every served version of every CRD in ``documents``."""
    out = {}
    for doc in documents:
        if not isinstance(doc, dict) or doc.get("kind") != "CustomResourceDefinition":
            continue
        spec = doc["spec"]
        group, kind = spec["group"], spec["names"]["kind"]
        for version in spec.get("versions", []):
            if not version.get("served", True):
                continue
            schema = version.get("schema", {}).get("openAPIV3Schema")
            if schema is None:
                continue
            out[file_name(kind, group, version["name"])] = pin_kind(strict(schema), kind,
                                                                     f"{group}/{version['name']}")
    return out


# --- Kubernetes' own kinds -------------------------------------------------------------------------
def expand(node: Any, definitions: dict[str, Any], seen: tuple[str, ...] = ()) -> Any:
    """``node`` with every ``$ref`` into ``definitions`` replaced by the definition (recursively)."""
    if isinstance(node, list):
        return [expand(item, definitions, seen) for item in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str):
        if ref == QUANTITY_REF:
            return dict(QUANTITY)
        name = ref.rsplit("/", 1)[-1]
        if name in seen:  # a recursive type (JSONSchemaProps); none of the kinds rendered has one
            return {}
        return expand(definitions[name], definitions, (*seen, name))
    return {key: expand(value, definitions, seen) for key, value in node.items()}


def kubernetes_schemas(swagger: dict[str, Any], kinds: Iterable[str]) -> dict[str, dict[str, Any]]:
    """File name -> stand-alone strict schema of each of ``kinds`` (``Kind.group/version``, ``Kind/v1``)."""
    definitions = swagger["definitions"]
    by_gvk = {}
    for name, definition in definitions.items():
        for gvk in definition.get("x-kubernetes-group-version-kind", []):
            by_gvk[(gvk["group"], gvk["version"], gvk["kind"])] = name
    out = {}
    for wanted in kinds:
        head, _, version = wanted.rpartition("/")
        kind, _, group = head.partition(".")
        name = by_gvk.get((group, version, kind))
        if name is None:
            raise SystemExit(f"no {kind} in group {group or 'core'} version {version} in the spec")
        schema = strict(expand(copy.deepcopy(definitions[name]), definitions))
        out[file_name(kind, group, version)] = pin_kind(schema, kind, f"{group}/{version}" if group else version)
    return out


def write(schemas: dict[str, dict[str, Any]], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, schema in sorted(schemas.items()):
        # One line per file: generated, never edited by hand, and a third of the size of indented JSON.
        (out / name).write_text(json.dumps(schema, sort_keys=True, separators=(",", ":")) + "\n")
        print(f"{out / name}: {(out / name).stat().st_size // 1024} KiB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="input", required=True)
    crd = sub.add_parser("crd", help="CustomResourceDefinition YAML files")
    crd.add_argument("files", nargs="+", type=Path)
    crd.add_argument("--only", action="append", default=[],
                     help="keep only this kind (repeatable; default: every CRD in the files)")
    crd.add_argument("--out", type=Path, required=True)
    k8s = sub.add_parser("kubernetes", help="Kubernetes' OpenAPI v2 spec (swagger.json)")
    k8s.add_argument("swagger", type=Path)
    k8s.add_argument("--kind", action="append", required=True,
                     help="Kind.group/version (Deployment.apps/v1) or Kind/version for the core group (Service/v1)")
    k8s.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.input == "crd":
        docs = [doc for path in args.files for doc in yaml.safe_load_all(path.read_text())]
        schemas = crd_schemas(docs)
        if args.only:
            keep = {k.lower() for k in args.only}
            schemas = {name: s for name, s in schemas.items() if name.split("-")[0] in keep}
    else:
        schemas = kubernetes_schemas(json.loads(args.swagger.read_text()), args.kind)
    write(schemas, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
