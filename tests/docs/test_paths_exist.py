"""Every repository path the docs and the code's docstrings and comments name exists.

Scans README.md, docs/**/*.md and the docstrings and comments of the project's Python files for
repo-relative paths: a word starting with one of the repository's top-level folders and ending in a
file extension or a slash (``streams/memory.py``, ``docs/stack.md``, ``tests/faults/``). URLs,
``~/...`` and ``.chatpipe/...`` state paths, globs and placeholders (``*``, ``<name>``, ``{x}``) are
not paths of the repository and are skipped. Relative Markdown links (``[x](stack.md#faults)``) must
resolve from the file that holds them. A failure lists each missing path with where it is named.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("chatpipe", "k8s", "gateway", "streams", "inference", "spark_jobs", "training", "clients", "capacity", "infra",
            "transport", "formats", "schemas", "bench", "examples", "tests")
TOP_LEVEL = (*PACKAGES, "docs")
# A word that starts with a top-level folder; what precedes it must not make it part of a longer path,
# a URL, a dotted name or a home path.
PATH = re.compile(r"(?<![\w./~@<>{}-])((?:" + "|".join(TOP_LEVEL) + r")/[\w./<>{}*-]*)")
# Names that look like repository paths and are not: what they are.
NOT_REPO_PATHS = {
    "gateway/keys.json": "a file of the state folder, .chatpipe/gateway/keys.json (docs/stack.md's listing of it)",
}
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _candidates(text: str):
    for match in PATH.finditer(text):
        path = match.group(1).rstrip(".,:;")
        if any(c in path for c in "<>{}*") or ".." in path or path in NOT_REPO_PATHS:
            continue
        last = path.rsplit("/", 1)[-1]
        if path.endswith("/") or re.search(r"\.[a-z0-9]{1,8}$", last):
            yield path


def _python_texts(path: Path):
    """The comments and docstrings of a Python file."""
    source = path.read_text(encoding="utf-8")
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT:
                yield token.string
    except (tokenize.TokenError, SyntaxError):
        pass
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield doc


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _python_files() -> list[Path]:
    files = []
    for package in PACKAGES:
        files += sorted(p for p in (ROOT / package).rglob("*.py") if "__pycache__" not in p.parts)
    return files


def _exists(path: str) -> bool:
    return (ROOT / path.rstrip("/")).exists()


def test_every_path_named_in_the_docs_and_docstrings_exists():
    missing: dict[str, set[str]] = {}
    for md in _markdown_files():
        for path in _candidates(md.read_text(encoding="utf-8")):
            if not _exists(path):
                missing.setdefault(path, set()).add(str(md.relative_to(ROOT)))
    for py in _python_files():
        for text in _python_texts(py):
            for path in _candidates(text):
                if not _exists(path):
                    missing.setdefault(path, set()).add(str(py.relative_to(ROOT)))
    assert not missing, "paths named that do not exist:\n" + "\n".join(
        f"  {path}  (in {', '.join(sorted(where))})" for path, where in sorted(missing.items()))


def _anchors(md: Path) -> set[str]:
    """The anchors GitHub gives ``md``'s headings: lower case, punctuation dropped, spaces to hyphens."""
    seen: dict[str, int] = {}
    anchors = set()
    in_code = False
    for line in md.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not re.match(r"#{1,6} ", line):
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", line.lstrip("#").strip())
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_every_relative_markdown_link_resolves():
    broken = []
    for md in _markdown_files():
        for target in LINK.findall(md.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = (md.parent / file) if file else md
            if not path.exists():
                broken.append(f"  {md.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"  {md.relative_to(ROOT)}: {target} (no heading with that anchor)")
    assert not broken, "links that do not resolve:\n" + "\n".join(broken)


def test_the_scanner_finds_paths_and_skips_what_is_not_one():
    found = set(_candidates("see streams/memory.py, docs/stack.md#faults and tests/faults/. Also "
                            "https://x.org/streams/a.py ~/.cache/chatpipe/bin .chatpipe/logs/x.log "
                            "schemas/avro/<Name>.avsc tests/*.py streams.memory inference/engine"))
    assert found == {"streams/memory.py", "docs/stack.md", "tests/faults/"}
