"""What the test suite builds or fetches once per machine, done before pytest starts (`make test`'s
`test-prerequisites` step): ``python -m chatpipe.testing.prerequisites``.

Each of these is cached outside the clone after the first time, so on most runs every line says
"cached". On a machine with nothing cached they took minutes inside some test's setup, where
``pytest -q`` shows nothing (Jaeger, Prometheus and Prometheus's UI alone: ~23 min on 2 cores). Here
each says before it starts what it builds, about how long it takes and where its log is, and when it
is done. The tests then only find them (tests/infra/test_observability_backends.py fails naming this
command when they are missing).

    redis           redis-server on PATH (apt, `make prerequisites`)     infra/redis_server.py
    kafka jars      the broker's classpath, from Maven Central (mvn)     infra/local_kafka.py
    spark jars      Spark's Kafka and Avro connectors (mvn)              spark_jobs/jars.py
    kubeconform     from the Go module proxy (go; seconds)               k8s/kubeconform.py
    observability   Jaeger, Prometheus and their UIs (go, npm; ~25 min)  infra/observability/binaries.py
    vllm            the vLLM worker's own environment (uv; ~6 GB)        infra/vllm_env.py

``--skip NAME`` (repeatable) leaves one out.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path


def say(message: str) -> None:
    print(f"test-prerequisites: {message}", flush=True)


def _step(name: str, cached: Callable[[], Path | None], build: Callable[[], object], about: str) -> None:
    found = cached()
    if found is not None:
        say(f"{name}: cached ({found})")
        return
    say(f"{name}: fetching/building, once on this machine ({about}) ...")
    began = time.monotonic()
    build()
    say(f"{name}: done in {time.monotonic() - began:.0f} s ({cached() or ''})")


def redis() -> None:
    """Nothing to build: Debian's redis-server, installed by `make prerequisites` (apt, as root) like Java.
    Checked here so that a machine without it fails in one line, not in each test that starts one."""
    import shutil

    from infra.settings import StackSettings

    program = StackSettings().redis_server
    found = shutil.which(program)
    if found is None:
        raise RuntimeError(f"{program!r} not found on PATH: the local stack's response cache and its tests "
                           "(chatpipe/testing/redis.py) run a real Redis; install it: apt-get install redis-server "
                           "(`make prerequisites` does as root), or name one with CHATPIPE_REDIS_SERVER")
    say(f"redis-server: found ({found})")


def kafka_jars() -> None:
    from infra.local_kafka import ensure_jars, kafka_version
    from infra.settings import StackSettings

    settings = StackSettings()
    lib = settings.cache_dir / f"kafka-{kafka_version()}" / "lib"
    _step(f"Kafka {kafka_version()} broker jars", lambda: lib if (lib / ".complete").exists() else None,
          lambda: ensure_jars(settings), f"mvn from Maven Central into {lib}, about 1-3 min")


def spark_jars() -> None:
    from spark_jobs.jars import connector_jars, spark_version
    from spark_jobs.settings import SparkSettings

    target = Path(SparkSettings().jars_cache_dir).expanduser() / spark_version()
    _step(f"Spark {spark_version()} connector jars", lambda: target if (target / ".complete").exists() else None,
          lambda: connector_jars(SparkSettings().jars_cache_dir), f"mvn from Maven Central into {target}, about 1 min")


def kubeconform() -> None:
    from infra.observability.binaries import program_path
    from infra.settings import StackSettings
    from k8s.kubeconform import KUBECONFORM, binary

    settings = StackSettings()
    path = program_path(settings, KUBECONFORM)
    _step(f"{KUBECONFORM.release}", lambda: path if path.is_file() else None,
          lambda: binary(settings),
          f"go from the module proxy into {path.parent}, seconds; log {path.parent}.build.log")


def observability() -> None:
    from infra.observability.binaries import build_all
    from infra.settings import StackSettings

    build_all(StackSettings(), lambda m: say(f"observability: {m}"))


def vllm() -> None:
    from infra.vllm_env import ensure, vllm_env

    env = vllm_env()
    _step(f"vLLM {env.flavour} environment", lambda: env.python if env.ready else None,
          lambda: ensure(env, lambda m: say(f"vllm: {m}")),
          "uv from PyPI into ~/.cache/chatpipe/vllm, ~6 GB the first time (uv's cache keeps it), then about 1 min")


STEPS = {"redis": redis, "kafka": kafka_jars, "spark": spark_jars, "kubeconform": kubeconform,
         "observability": observability, "vllm": vllm}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip", action="append", default=[], choices=sorted(STEPS), help="leave this one out")
    args = parser.parse_args(argv)
    for name, step in STEPS.items():
        if name in args.skip:
            say(f"{name}: skipped (--skip)")
            continue
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - one line naming the failed step, then stop
            say(f"{name} FAILED: {exc}")
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
