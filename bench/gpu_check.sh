#!/usr/bin/env bash
# The engine's GPU check (issues 10, 22), prepared for the lent H200 (`device` tool), which has python3
# 3.12 with torch and transformers but neither pydantic nor fastavro, and no network.
#
#   bash bench/gpu_check.sh prep     # here: wheels for python3.12 into .whl/ (git-ignored)
#   bash bench/gpu_check.sh cpu      # here: the same steps on CPU with .venv, tiny shapes (~1 min), to test this script
#   device run, carry [".whl"], timeout_s 560, command:  bash bench/gpu_check.sh run
#   (some parts only, e.g. a rerun of the profile:       bash bench/gpu_check.sh run profile)
#
# `run` stops at the first failure with a line `gpu_check: FAILED: <part> ...` (set -e; each part
# under `timeout`, all of them inside one budget of GPU_CHECK_BUDGET_S = 540 s, so the device
# call's 560 s is never the one that cuts it). Parts, in order, each logged to $OUT/<part>.log:
#   setup      wheels into /tmp/site, nvidia-smi, python3 imports the engine with CUDA      ~10 s (limit 60)
#   kernel     the Triton paged decode kernel vs its torch reference (tests/engine/test_paged_kernel.py) ~20 s (limit 90)
#   exactness  engine == HF generate token for token on CUDA (bench/gpu_exactness.py)     ~20 s (limit 60)
#   engine     engine vs HF generate tokens/s + batch-1 decode bandwidth, both shapes     ~200 s (limit 280)
#              (bench/engine.py --shapes; 197 s on 2026-11-30; log also $OUT/gpu.log, as before)
#   profile    torch.profiler over one decode and one mixed step, llama-1b and llama-8b,  ~120 s (limit 180)
#              each on the engine's default layers (lean_layers=auto: lean on CUDA) and on the HF
#              modules (off): 4 engines, each ~50 steps + 8 profiled ones (bench/profile_step.py;
#              table: docs/engine.md "Profile of one step"). Never run on a GPU yet, so its time is
#              a guess (most of it parsing the profiles) and it runs last: if it breaks, the
#              engine figures are already in; rerun it alone with `run profile`.
# Expected ~6 min in all; worst case the 540 s budget. A part over its limit fails the run (exit 124).
#
# Exactness is no longer `|| true`: a CUDA path that answers differently from HF generate is a bug,
# its throughput figures must not be reported, and the rest of the device time (15 minutes a session,
# all tries) is worth more for a rerun after the fix than for measuring a wrong engine. To measure
# anyway (e.g. bf16-only differences under study), run the parts explicitly: `run engine,profile`.
# Put the figures in README ("GPU") and docs/engine.md ("GPU figures", "Profile of one step").
set -euo pipefail
cd "$(dirname "$0")/.."
LOGS="${OUT:-/tmp/gpu_check}"
BUDGET="${GPU_CHECK_BUDGET_S:-540}"
START=$SECONDS
SUMMARY=()

fail() {
  echo "gpu_check: FAILED: $*" >&2
  [ ${#SUMMARY[@]} -eq 0 ] || echo "gpu_check: done before the failure: ${SUMMARY[*]}" >&2
  exit 1
}

# part NAME LIMIT_S CMD...: CMD under `timeout` (at most what is left of the budget), tee'd to $LOGS/NAME.log.
part() {
  local name=$1 limit=$2 left rc t0
  shift 2
  left=$((BUDGET - (SECONDS - START)))
  [ "$left" -ge 15 ] || fail "$name: not started, only ${left} s of the ${BUDGET} s budget left"
  [ "$limit" -le "$left" ] || limit=$left
  echo "== gpu_check: $name (limit ${limit} s; log $LOGS/$name.log): $*"
  t0=$SECONDS
  set +e
  timeout "$limit" "$@" 2>&1 | tee "$LOGS/$name.log"
  rc=${PIPESTATUS[0]}
  set -e
  if [ "$rc" -eq 124 ]; then
    fail "$name: timed out after ${limit} s (see $LOGS/$name.log)"
  elif [ "$rc" -ne 0 ]; then
    fail "$name: exit $rc after $((SECONDS - t0)) s (see $LOGS/$name.log)"
  fi
  SUMMARY+=("$name $((SECONDS - t0)) s;")
}

# steps PY DEVICE SHAPES PROFILE_FLAGS PARTS: the parts both `run` and `cpu` do.
steps() {
  local py=$1 dev=$2 shapes=$3 pflags=$4 parts=",$5,"
  # the Triton paged kernel compiled for the GPU against its torch reference (on CPU: the interpreter)
  case "$parts" in *,kernel,*) part kernel 90 env TRITON_INTERPRET="$([ "$dev" = cpu ] && echo 1 || echo 0)" \
    "$py" tests/engine/test_paged_kernel.py --device "$dev" ;; esac
  case "$parts" in *,exactness,*) part exactness 60 "$py" bench/gpu_exactness.py --device "$dev" ;; esac
  # shellcheck disable=SC2086
  case "$parts" in *,engine,*)
    part engine 280 "$py" bench/engine.py --device "$dev" --shapes "$shapes"
    cp "$LOGS/engine.log" "$LOGS/gpu.log" ;;
  esac
  case "$parts" in *,profile,*) part profile 180 "$py" bench/profile_step.py --device "$dev" --shapes "$shapes" --lean auto,off $pflags ;; esac
  echo "gpu_check: ok: ${SUMMARY[*]} total $((SECONDS - START)) s"
}

PARTS="${2:-kernel,exactness,engine,profile}"
case ",$PARTS," in *[!a-z,]*) fail "parts are a comma-separated list of kernel,exactness,profile,engine: got '$PARTS'" ;; esac
for p in ${PARTS//,/ }; do
  case "$p" in kernel | exactness | profile | engine) ;; *) fail "unknown part '$p' (kernel, exactness, profile, engine)" ;; esac
done

case "${1:-}" in
  prep)
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    mkdir -p .whl
    for pkg in pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 annotated-types==0.8.0 \
               typing-inspection==0.4.5 python-dotenv==1.2.4 fastavro; do
      python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$pkg"
    done
    ls -la .whl ;;
  run)
    mkdir -p "$LOGS"
    compgen -G ".whl/*.whl" > /dev/null || fail "setup: no wheels in .whl/: run 'bash bench/gpu_check.sh prep' here and carry [\".whl\"]"
    part setup 60 bash -c '
      set -e
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
      nvidia-smi -L
      PYTHONPATH="/tmp/site:$PWD" python3 -c "
import torch, transformers
assert torch.cuda.is_available(), \"torch.cuda.is_available() is False\"
import inference.engine.engine  # pydantic, pydantic-settings from the wheels
print(\"torch\", torch.__version__, \"transformers\", transformers.__version__, torch.cuda.get_device_name(0))"'
    export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
    steps python3 cuda llama-1b,llama-8b "" "$PARTS" ;;
  cpu)
    mkdir -p "$LOGS"
    PY=.venv/bin/python
    [ -x "$PY" ] || PY=python3
    export PYTHONUNBUFFERED=1
    steps "$PY" cpu tiny --quick "$PARTS" ;;
  *) echo "usage: bash bench/gpu_check.sh prep|run|cpu [kernel,exactness,profile,engine]" >&2; exit 2 ;;
esac
