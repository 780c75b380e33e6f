"""The Spark connector jars (Kafka source, spark-avro), fetched from Maven Central once.

pyspark ships Spark itself but not its Kafka source nor spark-avro. The first job that needs
them runs ``mvn dependency:copy-dependencies`` on ``infra/spark/pom.xml`` for the installed
Spark version into ``<cache>/<version>/`` (a temporary folder renamed into place, so an
interrupted download is never mistaken for a complete one); later runs reuse the folder.
Only the artifacts below are copied: everything else they depend on is on pyspark's classpath.

Not here: building the session (``session.py``).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from spark_jobs.errors import JarsUnavailableError

POM = Path(__file__).resolve().parent.parent / "infra" / "spark" / "pom.xml"

#: Artifacts pyspark lacks: the connectors and their own runtime dependencies.
ARTIFACTS = (
    "spark-sql-kafka-0-10_2.13",
    "spark-token-provider-kafka-0-10_2.13",
    "kafka-clients",
    "commons-pool2",
    "spark-avro_2.13",
)


def spark_version() -> str:
    import pyspark

    return pyspark.__version__


def connector_jars(cache_dir: Path, version: str | None = None, pom: Path = POM) -> list[Path]:
    """Paths of the connector jars for ``version`` (default: installed pyspark), fetching if needed."""
    version = version or spark_version()
    target = Path(cache_dir).expanduser() / version
    if target.is_dir() and (target / ".complete").exists():
        return sorted(target.glob("*.jar"))
    if not pom.is_file():  # an install without its package data: say so, not "Maven Central failed"
        raise JarsUnavailableError(
            f"{pom} is missing, so the Spark {version} connector jars cannot be fetched: this chatpipe "
            "install lacks its package data (infra/spark/pom.xml); reinstall chatpipe, or put the jars of "
            f"{', '.join(ARTIFACTS)} {version} into {target} and create an empty .complete file there."
        )
    mvn = shutil.which("mvn")
    if mvn is None:
        raise JarsUnavailableError(
            "Maven (mvn) is not on PATH; it fetches Spark's Kafka and Avro connectors from Maven "
            f"Central. Install Maven, or put the jars of {', '.join(ARTIFACTS)} {version} into {target} "
            "and create an empty .complete file there."
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=target.parent))
    cmd = [
        mvn, "-q", "-B", "-f", str(pom), "dependency:copy-dependencies",
        f"-Dspark.version={version}", f"-DoutputDirectory={tmp}", "-DincludeScope=runtime",
        f"-DincludeArtifactIds={','.join(ARTIFACTS)}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    jars = sorted(tmp.glob("*.jar"))
    if proc.returncode != 0 or len(jars) < len(ARTIFACTS):
        shutil.rmtree(tmp, ignore_errors=True)
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise JarsUnavailableError(
            f"could not fetch the Spark {version} connector jars from Maven Central "
            f"(mvn exit {proc.returncode}, {len(jars)} of {len(ARTIFACTS)} jars). Is "
            f"org.apache.spark:spark-sql-kafka-0-10_2.13:{version} published? If not, install the "
            f"newest pyspark whose connector is.\n{tail}"
        )
    (tmp / ".complete").touch()
    if target.exists():  # a half-finished folder from an older run without .complete
        shutil.rmtree(target)
    tmp.rename(target)
    return sorted(target.glob("*.jar"))
