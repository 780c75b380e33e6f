"""Every ``CHATPIPE_*`` variable from one source: the project's settings classes.

:func:`settings_classes` finds every pydantic-settings class of the project (walking its packages),
:func:`all_entries` lists the variables each reads (name, type, default, help from the field's
``description``), :func:`conflicts` names a variable two classes define differently (the settings
test fails on it), and :func:`render` writes ``docs/settings.md``::

    python -m chatpipe.settings_doc --write     # regenerate docs/settings.md
    python -m chatpipe.settings_doc --check     # exit 1 when docs/settings.md is stale
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from pydantic import AliasChoices, AliasPath
from pydantic_settings import BaseSettings

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("chatpipe", "k8s", "gateway", "streams", "inference", "spark_jobs", "training", "clients", "capacity", "infra",
            "transport", "schemas")
DOC = ROOT / "docs" / "settings.md"
REGENERATE = "python -m chatpipe.settings_doc --write"


def _modules(packages: Iterable[str]) -> list[str]:
    """Modules of ``packages`` whose source mentions BaseSettings (the others cannot define one;
    importing only these keeps torch and pyspark out)."""
    out = []
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "BaseSettings" not in path.read_text(encoding="utf-8"):
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def settings_classes(packages: Iterable[str] = PACKAGES) -> list[type[BaseSettings]]:
    """Every BaseSettings subclass defined in the project's packages, by module and name."""
    found: dict[str, type[BaseSettings]] = {}
    for module_name in _modules(packages):
        module = importlib.import_module(module_name)
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, BaseSettings) and value.__module__ == module_name:
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return [found[k] for k in sorted(found)]


@dataclass(frozen=True)
class Entry:
    """One variable one class reads."""

    name: str  # the variable, upper case
    field: str
    type: str
    default: str  # as text; "" = no default (required), "(computed)" = a default factory
    help: str
    owner: type[BaseSettings]

    @property
    def owner_name(self) -> str:
        return f"{self.owner.__module__}.{self.owner.__qualname__}"


def env_names(cls: type[BaseSettings], field_name: str) -> list[str]:
    """The variables that set ``cls.field_name``, the documented one first (upper case)."""
    field = cls.model_fields[field_name]
    alias = field.validation_alias or field.alias
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    if extra.get("env_names"):  # a value from a source of its own (transport.context_settings)
        names = list(extra["env_names"])
    elif isinstance(alias, AliasChoices):
        names = [c for c in alias.choices if isinstance(c, str)]
    elif isinstance(alias, str):
        names = [alias]
    elif isinstance(alias, AliasPath):
        names = [str(alias.path[0])]
    else:
        names = [f"{cls.model_config.get('env_prefix', '')}{field_name}"]
    return list(dict.fromkeys(n.upper() for n in names))


def type_text(annotation: Any) -> str:
    text = annotation.__name__ if isinstance(annotation, type) else repr(annotation)
    for noise in ("typing.", "pathlib.", "pydantic.types.", "NoneType"):
        text = text.replace(noise, "None" if noise == "NoneType" else "")
    return text


def default_text(cls: type[BaseSettings], field_name: str) -> str:
    field = cls.model_fields[field_name]
    factory = field.default_factory
    if factory is not None and not isinstance(factory, type) and getattr(factory, "__name__", "<lambda>") != "<lambda>":
        # A named function computes a value of this machine (home folder, host name): its docstring says which.
        return factory.__doc__.strip().splitlines()[0] if factory.__doc__ else "(computed)"
    if field.is_required():
        return ""
    value = field.get_default(call_default_factory=True)
    if isinstance(value, Path) and value.is_absolute():  # the same text in every clone, on every machine
        if value.is_relative_to(ROOT):
            return f"<clone>/{value.relative_to(ROOT)}"
        if value.is_relative_to(Path.home()):
            return f"~/{value.relative_to(Path.home())}"
    if hasattr(value, "get_secret_value"):
        return "(secret)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value)) if value else "(empty)"
    if value is None:
        return "(none)"
    if value == "":
        return "(empty)"
    return str(value)


def all_entries(classes: Iterable[type[BaseSettings]] | None = None) -> list[Entry]:
    """The variables each of ``classes`` reads (default: every settings class of the project)."""
    out = []
    for cls in settings_classes() if classes is None else classes:
        for field_name, field in cls.model_fields.items():
            for name in env_names(cls, field_name):
                out.append(Entry(name, field_name, type_text(field.annotation), default_text(cls, field_name),
                                 " ".join((field.description or "").split()), cls))
    return out


def conflicts(classes: Iterable[type[BaseSettings]] | None = None) -> list[str]:
    """One line per variable that two classes define with different defaults or types."""
    by_name: dict[str, list[Entry]] = {}
    for e in all_entries(classes):
        by_name.setdefault(e.name, []).append(e)
    out = []
    for name, group in sorted(by_name.items()):
        if len({(e.default, e.type) for e in group}) > 1:
            out.append(f"{name}: " + "; ".join(f"{e.owner_name}.{e.field} ({e.type}, default {e.default or 'none'})"
                                               for e in group))
    return out


def render(classes: Iterable[type[BaseSettings]] | None = None) -> str:
    classes = settings_classes() if classes is None else list(classes)
    rows = sorted(all_entries(classes), key=lambda e: (e.name, e.owner_name))
    lines = [
        "# Settings",
        "",
        f"<!-- Generated by `{REGENERATE}` from the settings classes; do not edit by hand. -->",
        "",
        "Every `CHATPIPE_*` environment variable, read by the settings class named in *owner* "
        "(pydantic-settings). A command-line flag of the same field wins over the variable, which wins over "
        "the default. A variable listed under several owners is one setting with one default "
        "(tests/settings/test_settings_unique.py keeps it so).",
        "",
        f"{len({e.name for e in rows})} variables, {len(classes)} settings classes.",
        "",
        "| Variable | Type | Default | Owner | Help |",
        "|---|---|---|---|---|",
    ]

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    for e in rows:
        lines.append(f"| `{e.name}` | `{cell(e.type)}` | {cell(f'`{e.default}`' if e.default else 'required')} | "
                     f"`{e.owner.__qualname__}` ({e.owner.__module__}) | {cell(e.help)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    if "--write" in argv:
        DOC.write_text(text, encoding="utf-8")
        print(f"wrote {DOC.relative_to(ROOT)}")
        return 0
    if "--check" in argv:
        if not DOC.is_file() or DOC.read_text(encoding="utf-8") != text:
            print(f"{DOC.relative_to(ROOT)} is not what the settings classes say; run `{REGENERATE}`")
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
