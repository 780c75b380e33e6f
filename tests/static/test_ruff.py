"""Lint, as CI enforces it: ``ruff check`` with the rules of pyproject.toml's ``[tool.ruff]`` (pyflakes,
pycodestyle errors and warnings, no debugger calls, each catch-all ``except`` justified, no unused
``noqa``), over the whole repository.

The first test fails with ruff's report; the second proves the check can fail (a file with an unused
import, checked with the project's configuration); the third keeps every ``noqa`` saying why
(``# noqa: CODE - reason``).
"""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NOQA = re.compile(r"#\s*noqa\b(?P<rest>.*)$")
WITH_REASON = re.compile(r"^: [A-Z]+[0-9]+(, ?[A-Z]+[0-9]+)* - \S")


def ruff(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """``ruff`` of this interpreter's environment (the ``test`` extra installs it), no cache written."""
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert exe, "ruff is not installed: pip install -e '.[test]'"
    return subprocess.run([exe, *args, "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_ruff_passes_on_the_repository():
    run = ruff("check", "--output-format", "concise", ".")
    assert run.returncode == 0, f"ruff check found problems (fix them, or `# noqa: CODE - reason`):\n" \
                                f"{run.stdout}\n{run.stderr}"


def test_ruff_fails_on_an_unused_import(tmp_path):
    bad = tmp_path / "bad_module.py"
    bad.write_text('"""A module with an unused import."""\n\nimport os\n')
    run = ruff("check", "--config", str(REPO / "pyproject.toml"), "--output-format", "concise", str(bad))
    assert run.returncode == 1, f"ruff passed an unused import\n{run.stdout}\n{run.stderr}"
    assert "F401" in run.stdout and "bad_module.py:3:" in run.stdout, run.stdout


def test_every_noqa_says_why():
    """Guards against a bare ``# noqa`` (everything suppressed) or a code without its reason."""
    bare = []
    for path in sorted(REPO.rglob("*.py")):
        if ".venv" in path.parts or "build" in path.parts:
            continue
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
        for token in tokens:
            m = NOQA.search(token.string) if token.type == tokenize.COMMENT else None
            if m and not WITH_REASON.match(m.group("rest")):
                bare.append(f"{path.relative_to(REPO)}:{token.start[0]}: {token.string}")
    assert not bare, "write `# noqa: CODE - why it is needed here`:\n" + "\n".join(bare)
