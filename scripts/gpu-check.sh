#!/usr/bin/env bash
# The GPU check in one command, cheapest part first, each figure printed as soon as it is
# measured (issue 46): needs a CUDA machine; exits non-zero on any failure.
#
#   bash scripts/gpu-check.sh                          # every part; sets up .venv first
#   bash scripts/gpu-check.sh --only 1b                # one part: tests, 1b, 8b or fleet
#   CONVEYOR_PYTHON=python3 bash scripts/gpu-check.sh  # a Python that already holds torch
#                                                      # with CUDA, the project's packages,
#                                                      # pytest and pytest-benchmark; the
#                                                      # wheels in .whl/ (scripts/
#                                                      # gpu-wheels.sh) are installed first
# Parts:
#   tests  the CUDA suite (tests/gpu), the decode-step benchmark on the device and the
#          host-to-device copies of each kind of step (worker/bench/step_copies.py)
#   1b, 8b make the preset on the device (bfloat16, in $CONVEYOR_GPU_MODELS, default
#          /tmp/conveyor-gpu-models) and time its decode steps (batch 1, 8, 64, 256 at
#          contexts of ~1,024, replayed from CUDA graphs and launched eagerly) against the
#          HBM floor and its 2,048-token prefill chunks against the GEMM peak
#          (worker/bench/device/step_floor.py)
#   fleet  W1 (1,024 requests) through one worker and a private Redis on the device beside
#          the offline engine, on the 1b preset, three repeats; then once beside
#          transformers' static batches and continuous batching (--baseline hf-static hf-cb)
# Further arguments go to the CUDA suite's pytest (e.g. -x, -k swaps).
set -euo pipefail
cd "$(dirname "$0")/.."
only=""
if [ "${1:-}" = "--only" ]; then
  only="${2:-}"
  shift $(( $# > 1 ? 2 : 1 ))
  case "$only" in tests|1b|8b|fleet) ;; *) echo "--only takes tests, 1b, 8b or fleet" >&2; exit 2;; esac
fi
if [ -n "${CONVEYOR_PYTHON:-}" ]; then
  py="$CONVEYOR_PYTHON"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  if compgen -G ".whl/*.whl" >/dev/null; then  # what scripts/gpu-wheels.sh fetched
    site="${TMPDIR:-/tmp}/conveyor-site"
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:$site"
  fi
else
  bash scripts/setup.sh
  py=.venv/bin/python
fi
models="${CONVEYOR_GPU_MODELS:-/tmp/conveyor-gpu-models}"
wants() { [ -z "$only" ] || [ "$only" = "$1" ]; }
model() {  # the preset's folder, made on the device the first time (again where an
           # earlier making stopped midway: a folder it marked, with no config.json yet)
  if [ ! -f "$models/$1/config.json" ]; then
    "$py" -m worker.cli make-model "$models/$1" --preset "$1" --device cuda --force >&2 \
      || return 1
  fi
  echo "$models/$1"
}
"$py" - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA device: the GPU check needs one"
print("device:", torch.cuda.get_device_name(0), "| torch", torch.__version__,
      "| CUDA", torch.version.cuda)
PY
if wants tests; then
  "$py" -m pytest tests/gpu -v --benchmark-disable "$@"
  "$py" -m pytest tests/benchmarks/test_bench_engine.py -k decode_small \
    --benchmark-only --benchmark-columns=min,median,mean
  "$py" -m worker.bench.step_copies
fi
for preset in 1b 8b; do
  if wants "$preset"; then
    echo "== $preset preset"
    dir=$(model "$preset")
    "$py" -m worker.bench.device.step_floor --model "$dir" \
      --json "$models/step-floor-$preset.json"
  fi
done
if wants fleet; then
  echo "== fleet: W1 on the 1b preset, a worker and Redis on the device, beside offline"
  dir=$(model 1b)
  "$py" -m worker.cli bench --model "$dir" --workload w1 --requests 1024 \
    --offline --repeat 3 --out "$models/bench-w1-1b"
  echo "== W1 on the 1b preset beside transformers (static batches of 256, continuous batching)"
  "$py" -m worker.cli bench --model "$dir" --workload w1 --requests 1024 --offline \
    --baseline hf-static hf-cb --hf-batch-size 256 --out "$models/bench-w1-1b-hf"
fi
