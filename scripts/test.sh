#!/usr/bin/env bash
# The test command: sets up .venv when needed, then runs the whole suite.
# Benchmarks run once each as smoke tests here; `--benchmark-only` measures them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest --benchmark-disable "$@"
