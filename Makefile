# chatpipe: `make run` sets up and runs the pipeline on the embedded defaults; `make test` sets up
# and runs the whole test suite. Both build the environment in .venv/ at the repo root.
# Heavy downloads are cached outside the clone: packages (~/.cache/uv), Maven (~/.m2), the Kafka
# classpath and the converted model (~/.cache/chatpipe).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
CHATPIPE := $(VENV)/bin/chatpipe
PYTEST_ARGS ?=
# Three pytest workers (pytest-xdist) on 2 cores, one torch thread each (tests/conftest.py): most of a
# test's time is waiting on the processes it started, so workers beyond the cores overlap more of it
# (docs/testing.md: 18 min 10 s and 20 min 27 s of tests in two runs with 4; 5.6 of 23 GiB left at the
# lowest point then). With the suite's later engines and stacks, 4 workers left 2.5 GiB at the lowest point
# in one run of 2026-12-07 (34 min) and ran the machine out of memory in the next (a worker holding
# engines killed at 3.9 GB): 3 trade some of the overlap for that headroom. `--dist loadfile` with tests/conftest.py's groups: a file's tests
# stay on one worker (module-scoped stacks stay in one process) and so do the folders whose files share
# a slow session fixture (the gateway's pipeline, Spark, the default model); each worker starts its own
# test broker. `--no-loadscope-reorder`: groups are handed out in collection order, which
# tests/conftest.py sorts longest first (xdist's own order, most tests first, left one-test stacks such
# as the erasure canary to start last while the other worker sat idle). PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 3

.PHONY: setup setup-vllm prerequisites run test test-prerequisites test-unit bench-quick down clean

# Java and Maven for the broker; redis-server for the stack's response cache (infra/redis_server.py). Debian's
# package starts its own redis-server.service on 6379 where systemd runs: only one installed here is stopped
# and disabled (`chatpipe up` runs the stack's own Redis on that port); one that was there is left alone.
# A C compiler for the CPU engine's decode attention kernel (inference/engine/kernels/cpu_paged_attention.py,
# built by setup; without one the engine keeps its slower gather + SDPA).
prerequisites:
	@command -v java >/dev/null && command -v mvn >/dev/null || { \
	  echo "Java 17 and Maven are needed (the Kafka broker runs on the JVM, its jars come from Maven Central)."; \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -q && apt-get install -y -q openjdk-17-jdk-headless maven; \
	  else echo "install them (e.g. apt-get install openjdk-17-jdk-headless maven) and rerun"; exit 1; fi; }
	@command -v redis-server >/dev/null || { \
	  echo "Redis is needed (redis-server: the local stack's response cache, and its tests)."; \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -q && apt-get install -y -q redis-server && \
	    { ! command -v systemctl >/dev/null || systemctl disable --now redis-server >/dev/null 2>&1 || true; }; \
	  else echo "install it (e.g. apt-get install redis-server) and rerun"; exit 1; fi; }
	@command -v cc >/dev/null || { \
	  echo "A C compiler is wanted (cc: the CPU engine's decode attention kernel is built with it)."; \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -q && apt-get install -y -q gcc; \
	  else echo "without one (e.g. apt-get install gcc) the CPU engine keeps its slower gather + SDPA attention"; fi; }
	@ls /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4 >/dev/null 2>&1 || { \
	  echo "tcmalloc is wanted (the CPU engines run with it preloaded: infra/allocator.py)."; \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get install -y -q libtcmalloc-minimal4 || { apt-get update -q && apt-get install -y -q libtcmalloc-minimal4; }; \
	  else echo "without it (e.g. apt-get install libtcmalloc-minimal4) our engine runs on glibc's malloc, ~12% slower"; fi; }

# uv installs the packages (from its cache, ~/.cache/uv, once they are there): 53 s here where pip
# took 107 s from its own cache, most of it unpacking torch's CUDA wheels again for every new venv.
# --compile-bytecode as pip does: where PYTHONDONTWRITEBYTECODE is set (CI here), nothing writes the
# .pyc files later, and every process the tests start compiled torch again (a run twice as slow).
# pyspark is published as a source archive only: uv built it again for every fresh venv (a minute)
# and kept each 470 MB build and 900 MB unpacked archive under a new cache revision (44 GB after a day
# of fresh clones filled this machine's disk and failed CI). So its wheel is built once, by pip (whose
# cache keeps the build), into WHEELHOUSE, and uv installs it from there.
WHEELHOUSE ?= $(HOME)/.cache/chatpipe/wheels
PYSPARK_PIN = $(shell grep -o 'pyspark==[0-9.]*' pyproject.toml)

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q uv
	@ls $(WHEELHOUSE)/$(subst ==,-,$(PYSPARK_PIN))-*.whl >/dev/null 2>&1 || { \
	  echo "building the $(PYSPARK_PIN) wheel once into $(WHEELHOUSE)"; \
	  $(PY) -m pip wheel -q --no-deps -w $(WHEELHOUSE) "$(PYSPARK_PIN)"; }
	$(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) --find-links $(WHEELHOUSE) -e ".[all,test]"
	touch $@

setup: prerequisites $(VENV)/.installed
	$(CHATPIPE) model pull
	$(PY) -m inference.engine.kernels.cpu_paged_attention

# The vLLM worker's own environment (`chatpipe inference --engine vllm`, `chatpipe up --engine vllm`): vLLM pins
# its own torch, so it cannot share .venv (infra/vllm_env.py). Made once per machine in ~/.cache/chatpipe/vllm
# (~6 GB of downloads the first time, kept by uv's cache); `make test` makes it too (test-prerequisites).
setup-vllm: $(VENV)/.installed
	$(PY) -m infra.vllm_env

# Start the whole stack in the background (Kafka + topic catalog, streams worker, inference worker,
# gateway), then run a short scripted conversation through the gateway (streaming, an earlier fact
# recalled). The stack keeps running: `.venv/bin/chatpipe chat` to talk to it, `make down` to stop it.
run: setup
	$(CHATPIPE) up
	$(CHATPIPE) demo

# What the tests build or fetch once per machine (Kafka and Spark jars with Maven; kubeconform, Jaeger,
# Prometheus and their UIs with Go and npm: ~16 min the first time on 2 cores (docs/testing.md), cached in ~/.cache/chatpipe
# after that), built before pytest so that each says what it builds, how long it takes and where its log
# is (pytest -q would show nothing). `make test-prerequisites` alone is fine too.
test-prerequisites: setup
	$(PY) -m chatpipe.testing.prerequisites

test: setup test-prerequisites
	$(PY) -m pytest -q --timeout=900 -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The tests that need no service, no JVM, no Go and no pulled model: only the venv, so no `setup`
# (which needs Java and Maven and pulls the model).
test-unit: $(VENV)/.installed
	$(PY) -m pytest -q -m "not integration and not model and not spark and not go and not java" $(PYTEST_ARGS)

bench-quick: setup
	$(PY) bench/kafka_io.py --quick
	$(PY) bench/kafka_hop.py --quick
	$(PY) bench/engine.py --quick
	$(PY) bench/lora.py --quick
	$(PY) bench/finetune.py --quick
	$(PY) bench/worker.py --quick
	$(PY) bench/intake.py --quick
	$(PY) bench/memory.py --quick
	$(PY) bench/e2e.py --quick
	$(PY) bench/batch.py --quick
	$(PY) bench/train.py --quick
	$(PY) bench/learn_facts.py --quick

down:
	-$(CHATPIPE) down

clean: down
	rm -rf $(VENV) .chatpipe
