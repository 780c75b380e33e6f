"""Runnable scripts never import the test suite, and no product module imports the test harness.

``bench/*.py`` and ``examples/**/*.py`` are run as scripts by users; what they share with the tests
(the stack harness: ports, processes, the Kafka helpers, the worker/streams/gateway harnesses) is in
``chatpipe/testing/``. A ``tests`` import there would make a script depend on the test tree (and on
pytest's conftest side effects), so this check fails, listing every offender, as soon as one appears.
The second check keeps ``chatpipe.testing`` out of the services: it is for tests and benchmarks only.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRODUCT_PACKAGES = ("chatpipe", "schemas", "formats", "transport", "inference", "gateway", "streams", "spark_jobs", "training",
                    "clients", "capacity", "infra", "k8s")


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, nested ones (inside functions) included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def offenders(paths, banned: str) -> list[str]:
    return [f"{path.relative_to(REPO)}:{line}: imports {module}"
            for path in paths for line, module in imported_modules(path)
            if module == banned or module.startswith(banned + ".")]


def scripts() -> list[Path]:
    return sorted(REPO.glob("bench/*.py")) + sorted(REPO.glob("examples/**/*.py"))


def test_there_are_scripts_to_check():
    assert any(p.parent.name == "bench" for p in scripts()), "no bench/*.py found: is REPO right?"


def test_no_bench_or_example_script_imports_tests():
    found = offenders(scripts(), "tests")
    assert not found, ("scripts import the test suite; import the shared harness from chatpipe.testing instead:\n"
                       + "\n".join(found))


def test_no_product_module_imports_the_test_harness():
    harness = REPO / "chatpipe" / "testing"
    modules = [p for package in PRODUCT_PACKAGES for p in sorted((REPO / package).rglob("*.py"))
               if harness not in p.parents]
    found = offenders(modules, "chatpipe.testing")
    assert not found, "product modules import chatpipe.testing (the tests' and benches' harness):\n" + "\n".join(found)
