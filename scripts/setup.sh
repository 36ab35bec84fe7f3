#!/usr/bin/env bash
# Make (or refresh) the project's virtual environment at .venv. Idempotent and quiet when
# nothing changed: a stamp records the hash of pyproject.toml it was installed from.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.conveyor-installed

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi

want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi

pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: installing torch (CUDA build)" >&2
    pip install "torch>=2.4"
  else
    # Without a GPU take the CPU build: an unpinned torch would pull a multi-GB CUDA build.
    echo "setup: installing torch 2.13.0 (CPU build)" >&2
    pip install "torch==2.13.0"
  fi
fi

echo "setup: installing conveyor with its worker, redis-server and dev extras" >&2
pip install -e ".[worker,redis-server,dev]"
"$VENV/bin/python" -c "import torch, producer, worker" # fails loudly if the install did not take
echo "$want" > "$STAMP"
