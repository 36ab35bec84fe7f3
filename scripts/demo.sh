#!/usr/bin/env bash
# The main job: sets up .venv when needed, then runs `conveyor demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/conveyor demo "$@"
