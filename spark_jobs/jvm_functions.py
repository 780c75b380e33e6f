"""The project's own Java functions for Spark SQL (``infra/spark/udf/*.java``): text hashes and counts.

Three functions, registered per session as SQL functions:

- ``chatpipe_ngram_xxhash64(text_bytes, n)``: array of the xxhash64 (seed 42) of every word
  ``n``-gram of the normalised text (decontamination, ``decontam.py``);
- ``chatpipe_minhash_signature(text_bytes, n, "a:b,...")``: the MinHash signature of the text's
  word ``n``-shingles, one value per hash function (near-dedup, ``dedup.py``);
- ``chatpipe_text_chars(text, prose_punct, long_run)``: the number of text characters of an
  answer (quality ``mostly_non_text``, ``filters.py``).

Each returns what the Spark SQL expressions it replaces compute (``NGram`` + ``xxhash64``;
``crc32`` + ``min((a*h+b) mod P)``; two ``regexp_replace`` + ``length``), so the job's outputs
are the same with or without them (``tests/spark/test_jvm_functions.py``). Why Java: in Spark
SQL every n-gram became a row of its own (a 200-word turn, ~200 rows through explode, hash,
join or aggregate) and was built as a string first; that was about half of the job's CPU time
at 200k turns; the two regex scans of every answer were most of the quality step's.

The jar is compiled with ``javac`` against pyspark's own jars on first use into
``<jars cache>/functions/chatpipe-functions-<hash>.jar`` (the hash covers the sources and the
Spark version; written to a temporary name and renamed) and travels like the connector jars
(``spark.jars``; ``--jars`` under spark-submit). Without ``javac`` (a JRE-only machine) or with
``--no-jvm-functions`` the job computes the same values in Spark SQL, slower, and says so once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent.parent / "infra" / "spark" / "udf"

JAR_PREFIX = "chatpipe-functions-"

NGRAM_XXHASH64 = "chatpipe_ngram_xxhash64"
MINHASH_SIGNATURE = "chatpipe_minhash_signature"
TEXT_CHARS = "chatpipe_text_chars"
#: SQL name -> (Java class, return type)
FUNCTIONS = {
    NGRAM_XXHASH64: ("chatpipe.spark.TextHashes$NgramXxhash64", "array<bigint>"),
    MINHASH_SIGNATURE: ("chatpipe.spark.TextHashes$MinhashSignature", "array<bigint>"),
    TEXT_CHARS: ("chatpipe.spark.TextQuality$TextChars", "int"),
}


def _javac() -> str | None:
    # JAVA_HOME is the JDK's variable, not a chatpipe setting: the javac of the JDK pyspark's launcher starts
    # (it reads JAVA_HOME from the environment, spark_jobs/jvm_archive.py), so the jar targets the JVM that loads it.
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "javac").exists():
        return str(Path(home) / "bin" / "javac")
    return shutil.which("javac")


def functions_jar(cache_dir: Path) -> Path | None:
    """The compiled functions jar (built now if needed), or None when it cannot be built here."""
    import pyspark

    sources = sorted(SOURCE_DIR.glob("*.java"))
    if not sources:
        log.warning("no Java sources in %s (an install without its package data): using Spark SQL", SOURCE_DIR)
        return None
    digest = hashlib.sha256(pyspark.__version__.encode())
    for src in sources:
        digest.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    target = Path(cache_dir).expanduser() / "functions" / f"{JAR_PREFIX}{digest.hexdigest()[:16]}.jar"
    if target.exists():
        return target
    javac = _javac()
    if javac is None:
        log.warning("javac not found (a JRE without a JDK?): the job computes n-gram hashes in Spark SQL, "
                    "the same results, slower; install a JDK to speed it up")
        return None
    spark_jars = Path(pyspark.__file__).parent / "jars"
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as build:
        proc = subprocess.run([javac, "-nowarn", "--release", "17", "-d", build, "-cp", f"{spark_jars}/*",
                               *map(str, sources)], capture_output=True, text=True, timeout=300)  # fmt: skip
        if proc.returncode != 0:
            log.warning("javac failed on %s: the job uses Spark SQL instead (same results, slower):\n%s",
                        SOURCE_DIR, (proc.stdout + proc.stderr).strip()[-2000:])
            return None
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as jar:
            for cls in sorted(Path(build).rglob("*.class")):
                info = zipfile.ZipInfo(cls.relative_to(build).as_posix(), date_time=(1980, 1, 1, 0, 0, 0))
                jar.writestr(info, cls.read_bytes())
        tmp.replace(target)  # atomic: a concurrent job never loads half a jar
    return target


def register(spark) -> bool:
    """Register the functions on ``spark``; False (and a warning) when the JVM cannot load them."""
    from pyspark.sql.types import _parse_datatype_string

    try:
        for name, (cls, returns) in FUNCTIONS.items():
            spark.udf.registerJavaFunction(name, cls, _parse_datatype_string(returns))
    except Exception as exc:  # noqa: BLE001 - py4j/analysis errors: class not on the driver's classpath
        log.warning("the project's Java functions are not loadable (%s): using Spark SQL (same results, slower)",
                    str(exc).splitlines()[0][:200])
        return False
    return True


def registered(spark) -> bool:
    """Whether the job may call the functions on this session (``session.build_session`` registers them)."""
    return all(spark.catalog.functionExists(name) for name in FUNCTIONS)
