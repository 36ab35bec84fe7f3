#!/usr/bin/env bash
# The GPU check in one command: the CUDA test suite, then the decode-step benchmark on the
# device and the host-to-device copies of each kind of step (worker/bench/step_copies.py).
# Needs a CUDA machine; prints what it ran and exits non-zero on any failure.
#
#   bash scripts/gpu-check.sh                          # sets up .venv first (scripts/setup.sh)
#   CONVEYOR_PYTHON=python3 bash scripts/gpu-check.sh  # a Python that already holds torch
#                                                      # with CUDA, the project's packages,
#                                                      # pytest and pytest-benchmark
# Extra arguments go to the CUDA suite's pytest (e.g. -x, -k swaps).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${CONVEYOR_PYTHON:-}" ]; then
  py="$CONVEYOR_PYTHON"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  bash scripts/setup.sh
  py=.venv/bin/python
fi
"$py" - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA device: the GPU check needs one"
print("device:", torch.cuda.get_device_name(0), "| torch", torch.__version__,
      "| CUDA", torch.version.cuda)
PY
"$py" -m pytest tests/gpu -v --benchmark-disable "$@"
"$py" -m pytest tests/benchmarks/test_bench_engine.py -k decode_small \
  --benchmark-only --benchmark-columns=min,median,mean
"$py" -m worker.bench.step_copies
