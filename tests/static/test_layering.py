"""The layering of the packages, as CI enforces it: ``lint-imports`` (import-linter) with the
contracts in pyproject.toml's ``[tool.importlinter]``.

Top to bottom: ``chatpipe`` (CLI, cross-tier wiring) > ``k8s`` > the tiers (``gateway | streams |
inference.worker | spark_jobs | clients | capacity | infra``) > ``inference.engine`` (the model) >
``transport | formats`` > ``schemas``. A package imports only from the layers below its own, packages
of one layer never import one another, only the inference worker (and chatpipe, k8s) imports the
model, and no package's modules import one another in a cycle. Function-local imports count.

The first test runs the contracts on the working tree and fails with import-linter's report (which
contract, which import chain). The others prove the check can fail: a copy of the packages with one
import that breaks a contract, checked the same way, must be refused naming that contract.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIG = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
CONTRACTS = {c["id"]: c["name"] for c in CONFIG["contracts"]}
# The console script's entry point, run by this interpreter (no reliance on PATH or an activated venv).
LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` run in ``root`` (its pyproject.toml, its packages first on the path); no cache
    written into the tree."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    return subprocess.run([sys.executable, "-c", LINT_IMPORTS, "--no-cache", "--no-logo"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_packages_keep_their_layers():
    run = lint_imports(REPO)
    assert run.returncode == 0, f"lint-imports: a contract is broken\n{run.stdout}\n{run.stderr}"
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in run.stdout, run.stdout


def test_every_project_package_is_under_contract():
    """Guards against a new top-level package left out of root_packages (its imports unchecked)."""
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests", "bench", "examples"}
    assert packages <= set(CONFIG["root_packages"]), sorted(packages - set(CONFIG["root_packages"]))


@pytest.fixture(scope="module")
def project_copy(tmp_path_factory) -> Path:
    """The project's packages (Python files only) and pyproject.toml, copied."""
    root = tmp_path_factory.mktemp("layering")
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    for package in CONFIG["root_packages"]:
        shutil.copytree(REPO / package, root / package,
                        ignore=lambda d, names: [n for n in names if n == "__pycache__"
                                                 or (not n.endswith(".py") and not (Path(d) / n).is_dir())])
    return root


BREAKS = [
    # (module, a line appended to it, a contract it breaks, what the report names); one import may
    # break more than one contract (gateway -> the engine also reaches torch)
    ("gateway/tools.py", "import inference.engine.engine", "engine-in-inference",
     "gateway.tools -> inference.engine.engine"),
    ("schemas/records.py", "from transport import settings", "layers", "schemas.records -> transport.settings"),
    ("streams/tokens.py", "from gateway import app", "layers", "streams.tokens -> gateway.app"),
    # the cycle fixed by gateway/streaming.py, back as a function-local import
    ("gateway/completions.py", "def _cycle():\n    from gateway.app import create_app", "acyclic", "gateway"),
    ("formats/errors.py", "import torch", "no-torch", "formats.errors -> torch"),
    ("schemas/errors.py", "import os", "pure-contracts", "schemas.errors -> os"),
    ("streams/record.py", "from streams.faust_runtime import acks", "agents-without-faust",
     "streams.record -> streams.faust_runtime.acks"),
]


@pytest.mark.parametrize("module,line,contract,named", BREAKS, ids=[f"{b[2]}:{b[0]}" for b in BREAKS])
def test_an_import_across_the_layers_fails_the_check(project_copy, module, line, contract, named):
    path = project_copy / module
    original = path.read_text()
    try:
        path.write_text(original + "\n\n" + line + "\n")
        run = lint_imports(project_copy)
    finally:
        path.write_text(original)
    assert run.returncode != 0, f"lint-imports passed with {line!r} in {module}\n{run.stdout}"
    broken = run.stdout.split("Broken contracts", 1)[-1]
    assert f"{CONTRACTS[contract]} BROKEN" in " ".join(run.stdout.split()), run.stdout
    assert named in broken, run.stdout
