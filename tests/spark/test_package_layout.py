"""What ships in the ``spark_jobs`` product package, and what must not.

Test-data generation and the benchmark baseline once lived in ``spark_jobs`` (so every install
carried them and the product's modules could come to depend on them); they now live in
``chatpipe/testing/synthetic_log.py`` and ``bench/finetune_reference.py``.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import spark_jobs


def test_test_data_and_bench_baseline_are_not_in_the_product_package() -> None:
    assert importlib.util.find_spec("spark_jobs.synthetic") is None
    assert importlib.util.find_spec("spark_jobs.reference") is None


def test_no_product_module_imports_tests_or_bench() -> None:
    offenders = []
    for path in Path(spark_jobs.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])  # fmt: skip
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ("tests", "bench")]
    assert offenders == []
