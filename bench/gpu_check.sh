#!/usr/bin/env bash
# The engine's GPU check (issue 10), prepared for the lent H200 (`device` tool), which has python3
# 3.12 with torch and transformers but neither pydantic nor fastavro, and no network.
#
#   bash bench/gpu_check.sh prep     # here: wheels for python3.12 into .whl/ (git-ignored)
#   device run, carry [".whl"], timeout_s 560, command:  bash bench/gpu_check.sh run
#
# `run` first checks engine == HF generate token for token on CUDA (bench/gpu_exactness.py), then
# prints the engine vs HF generate tokens/s and the batch-1 decode bandwidth as a share of
# the GPU's memory bandwidth for random-init Llama-1B and Llama-8B shapes in bf16; the log is
# also written to $OUT/gpu.log. Put the figures in README ("GPU") and docs/engine.md.
set -euo pipefail
cd "$(dirname "$0")/.."
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
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
    nvidia-smi -L
    python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
    timeout 60 python3 bench/gpu_exactness.py --device cuda 2>&1 | tee "${OUT:-/tmp}/exactness.log" || true
    timeout 470 python3 bench/engine.py --device cuda --shapes llama-1b,llama-8b 2>&1 | tee "${OUT:-/tmp}/gpu.log" ;;
  *) echo "usage: bash bench/gpu_check.sh prep|run" >&2; exit 2 ;;
esac
