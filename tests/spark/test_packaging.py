"""An installed (non-editable) chatpipe carries what the Spark jobs need to fetch their jars.

A real wheel is built from a copy of the sources (pip, offline, no build isolation) and
installed into a folder of its own; the checks import ``spark_jobs.jars`` from that install,
not from this checkout. No Spark and no Maven run here.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("chatpipe", "schemas", "streams", "inference", "spark_jobs", "transport", "infra", "clients")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(wheel, folder the wheel was installed into)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for package in PACKAGES:  # a copy: building in the checkout would leave build/ and egg-info in it
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(root / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    wheel = next((root / "dist").glob("chatpipe-*.whl"))
    site = root / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site),
                    str(wheel)], check=True, capture_output=True, timeout=300)
    return wheel, site


def _run_installed(site: Path, code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter that imports chatpipe's packages from ``site`` (ahead of this
    checkout's editable install; third-party packages still come from the venv)."""
    return subprocess.run([sys.executable, "-c", code], cwd=site.parent, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(site.parent)})


def test_wheel_ships_the_spark_pom(installed):
    """Catches infra/spark/pom.xml missing from the package data: an installed chatpipe then cannot
    fetch the Kafka/Avro connector jars at all."""
    wheel, site = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "infra/spark/pom.xml" in names
    proc = _run_installed(site, "import spark_jobs.jars as j; print(j.__file__); print(j.POM.is_file())")
    assert proc.returncode == 0, proc.stderr
    where, found = proc.stdout.split()
    assert Path(where).is_relative_to(site), "the check must import the installed copy"
    assert found == "True"


def test_missing_pom_is_named_not_maven_central(installed, tmp_path):
    """Catches the error blaming Maven Central (or the Spark version) when the pom itself is absent."""
    _, site = installed
    broken = tmp_path / "site"
    shutil.copytree(site, broken)
    (broken / "infra" / "spark" / "pom.xml").unlink()
    proc = _run_installed(broken, (
        "from pathlib import Path\n"
        "from spark_jobs.errors import JarsUnavailableError\n"
        "from spark_jobs.jars import connector_jars\n"
        "try:\n"
        f"    connector_jars(Path({str(tmp_path / 'cache')!r}), version='4.2.0')\n"
        "except JarsUnavailableError as exc:\n"
        "    print(exc)\n"))
    assert proc.returncode == 0, proc.stderr
    message = proc.stdout.strip()
    assert f"{broken / 'infra' / 'spark' / 'pom.xml'} is missing" in message
    assert "Maven Central" not in message and "published" not in message
    assert not (tmp_path / "cache" / "4.2.0").exists()


def test_wheel_ships_the_java_functions(installed, tmp_path):
    """Catches the Java sources missing from the package data: an installed chatpipe would then fall
    back to the slower Spark SQL path for n-gram hashes without anyone noticing but a warning."""
    wheel, site = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"infra/spark/udf/TextHashes.java", "infra/spark/udf/TextQuality.java"} <= names
    proc = _run_installed(site, (
        "from pathlib import Path\n"
        "from spark_jobs import jvm_functions\n"
        f"print(jvm_functions.functions_jar(Path({str(tmp_path / 'cache')!r})))\n"))
    assert proc.returncode == 0, proc.stderr
    jar = Path(proc.stdout.strip())
    assert jar.is_relative_to(tmp_path / "cache") and jar.suffix == ".jar"
    classes = set(zipfile.ZipFile(jar).namelist())
    assert {"chatpipe/spark/TextHashes$NgramXxhash64.class", "chatpipe/spark/TextQuality$TextChars.class"} <= classes
