#!/usr/bin/env bash
# The GPU check in one command: the CUDA test suite, then the decode-step benchmark on the
# device. Needs a CUDA machine; prints what it ran and exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA device: the GPU check needs one"
print("device:", torch.cuda.get_device_name(0), "| torch", torch.__version__,
      "| CUDA", torch.version.cuda)
PY
.venv/bin/python -m pytest tests/gpu -v --benchmark-disable "$@"
.venv/bin/python -m pytest tests/benchmarks/test_bench_engine.py -k decode_small \
  --benchmark-only --benchmark-columns=min,median,mean
