#!/usr/bin/env bash
# Make (or refresh) the project's virtual environment at .venv. Idempotent and quiet when
# nothing changed: a stamp records the hash of pyproject.toml it was installed from.
set -euo pipefail
cd "$(dirname "$0")/.."

# Tests that need a Redis 7 built with TLS skip without one (and fail under CI=true). In CI (or with
# CONVEYOR_INSTALL_TEST_DEPS=1), as root with apt, install Debian's redis-server for them;
# a machine that already has one is left alone, and nothing here runs elsewhere.
has_redis7_tls() {
  local bin out
  bin=$(command -v redis-server) || return 1
  out=$("$bin" --version 2>/dev/null) || return 1
  [[ $out =~ \ v=([0-9]+)\. ]] && [ "${BASH_REMATCH[1]}" -ge 7 ] || return 1
  # A build without TLS refuses the directive; a TLS build stops at "not listening anywhere".
  out=$(timeout 10 "$bin" --port 0 --tls-port 0 --save '' 2>&1 </dev/null) || true
  [[ $out != *"Bad directive"* ]]
}
if { [ "${CI:-}" = true ] || [ "${CONVEYOR_INSTALL_TEST_DEPS:-}" = 1 ]; } \
    && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && ! has_redis7_tls; then
  echo "setup: installing redis-server (Redis 7 with TLS) for the tests" >&2
  if apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server \
      >/dev/null; then
    # The package may start a system service on port 6379; tests run their own servers.
    service redis-server stop >/dev/null 2>&1 || true
    update-rc.d redis-server disable >/dev/null 2>&1 || true
  else
    echo "setup: could not install redis-server; the tests that need it will be skipped" \
      "(or fail, under CI=true)" >&2
  fi
fi

# The TLS tests make their certificates with the openssl command: the same switches install
# it where missing.
if { [ "${CI:-}" = true ] || [ "${CONVEYOR_INSTALL_TEST_DEPS:-}" = 1 ]; } \
    && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
    && ! command -v openssl >/dev/null 2>&1; then
  echo "setup: installing openssl (test certificates)" >&2
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssl \
    >/dev/null) || echo "setup: could not install openssl; the TLS tests will be skipped" \
    "(or fail, under CI=true)" >&2
fi

# The Node.js client in the tests (tests/node_client) is required under CI=true. With the
# same switches, as root with apt, install node and npm where missing, then the client's
# packages as package-lock.json pins them (npm ci, only when node_modules differs). Elsewhere
# the test runs npm ci itself, or skips and says why.
node_client_current() {
  (cd tests/node_client && node -e '
    const fs = require("fs");
    const want = JSON.parse(fs.readFileSync("package-lock.json")).packages;
    delete want[""];
    const have = JSON.parse(fs.readFileSync("node_modules/.package-lock.json")).packages;
    process.exit(require("util").isDeepStrictEqual(want, have) ? 0 : 1);' 2>/dev/null)
}
if [ "${CI:-}" = true ] || [ "${CONVEYOR_INSTALL_TEST_DEPS:-}" = 1 ]; then
  missing=()
  command -v node >/dev/null 2>&1 || missing+=(nodejs)
  command -v npm >/dev/null 2>&1 || missing+=(npm)
  if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing ${missing[*]} for the Node client test" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      "${missing[@]}" >/dev/null || echo "setup: could not install ${missing[*]}" >&2
  fi
  if command -v npm >/dev/null 2>&1 && ! node_client_current; then
    echo "setup: installing the Node client's packages (npm ci in tests/node_client)" >&2
    (cd tests/node_client && npm ci --no-audit --no-fund --loglevel=error >&2) \
      || echo "setup: npm ci failed in tests/node_client" >&2
  fi
fi

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
pip install -e ".[worker,redis-server,gateway,dev]"
"$VENV/bin/python" -c "import torch, producer, worker" # fails loudly if the install did not take
# Start the CPU kernels' build in the background: engines serve on the torch path until it
# is done, the tests wait for it. Where they cannot be built, the torch path: not an error.
"$VENV/bin/python" -m worker.host.cpu_kernels --background >&2 || true
echo "$want" > "$STAMP"
