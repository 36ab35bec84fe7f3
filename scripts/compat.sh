#!/usr/bin/env bash
# Real OpenAI clients that nobody here wrote, against a local fleet: guidellm with its
# default chat settings, NVIDIA aiperf (chat, streamed), and lm-eval with a local
# multiple-choice task (loglikelihoods: completions with echo and logprobs). Prints each
# tool's summary; exits non-zero when any of them fails. Outside CI: the three tools are
# heavy, and go into their own virtual environment (.compat-venv, made on first use, with
# the CPU build of torch where there is no GPU). Usage:
#
#   bash scripts/compat.sh            # all three
#   bash scripts/compat.sh lm-eval    # one or more of: guidellm aiperf lm-eval
#
# The fleet: a private Redis in a temporary folder, one worker serving the small model
# (made by `conveyor make-model` if missing) as "small", and `conveyor gateway` on
# $COMPAT_PORT (default 8765). Everything it started is stopped on exit; COMPAT_KEEP=1 keeps
# the tools' whole output, the fleet's logs and the reports (the path is printed).
set -euo pipefail
cd "$(dirname "$0")/.."

tools=("$@")
[ ${#tools[@]} -gt 0 ] || tools=(guidellm aiperf lm-eval)
for tool in "${tools[@]}"; do
  case $tool in guidellm|aiperf|lm-eval) ;; *) echo "compat: unknown tool $tool" >&2; exit 2;; esac
done

bash scripts/setup.sh
VENV=${COMPAT_VENV:-.compat-venv}
PORT=${COMPAT_PORT:-8765}
MODEL_NAME=small
cpip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
if [ ! -x "$VENV/bin/lm_eval" ] || [ ! -x "$VENV/bin/aiperf" ] || [ ! -x "$VENV/bin/guidellm" ]; then
  echo "compat: installing guidellm, aiperf and lm-eval into $VENV (once; a few minutes)" >&2
  [ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null \
      && ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
    cpip install "torch==2.13.0"  # the CPU build: unpinned, lm-eval would pull a CUDA one
  fi
  cpip install guidellm aiperf "lm-eval[api]"
fi

work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  .venv/bin/conveyor redis stop --data-dir "$work/redis" >/dev/null 2>&1 || true
  if [ -n "${COMPAT_KEEP:-}" ]; then echo "compat: logs and reports kept in $work" >&2
  else rm -rf "$work"; fi
}
trap cleanup EXIT

model=$(.venv/bin/conveyor make-model --preset small --exist-ok 2>/dev/null | tail -1)
.venv/bin/conveyor redis run --data-dir "$work/redis" >"$work/redis.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do
  url=$(.venv/bin/conveyor redis status --data-dir "$work/redis" --json 2>/dev/null \
    | .venv/bin/python -c 'import json,sys; s=json.load(sys.stdin); print(s["url"] if s["running"] else "")' \
    2>/dev/null || true)
  [ -n "$url" ] && break
  sleep 0.1
done
[ -n "$url" ] || { echo "compat: the Redis did not start ($work/redis.log)" >&2; exit 1; }
.venv/bin/conveyor --log-level warning worker --model "$model" --served-model-name "$MODEL_NAME" \
  --redis "$url" >"$work/worker.log" 2>&1 &
pids+=($!)
.venv/bin/conveyor --log-level warning gateway --redis "$url" --port "$PORT" \
  >"$work/gateway.log" 2>&1 &
pids+=($!)
base="http://127.0.0.1:$PORT"
for _ in $(seq 600); do
  if curl -fs "$base/v1/models" 2>/dev/null | grep -q "\"$MODEL_NAME\""; then ready=1; break; fi
  sleep 0.2
done
[ -n "${ready:-}" ] || { echo "compat: the fleet did not come up" >&2; tail -20 "$work"/*.log >&2; exit 1; }
echo "compat: fleet up ($MODEL_NAME from $model, gateway $base)" >&2

failed=()
run() {  # run NAME COMMAND...: the tool's output to its log, its summary to stdout
  local name=$1
  shift
  echo "=== $name ==="
  if ! "$@" >"$work/$name.out" 2>&1; then
    echo "compat: $name failed (exit $?); its last lines:" >&2
    tail -40 "$work/$name.out" >&2
    failed+=("$name")
  elif ! .venv/bin/python scripts/compat/report.py "$name" "$work"; then
    failed+=("$name")
  fi
}

for tool in "${tools[@]}"; do
  case $tool in
    guidellm)
      # Its defaults: chat completions, streamed, with continuous usage stats.
      run guidellm "$VENV/bin/guidellm" run \
        --backend "kind=openai_http,target=$base,model=$MODEL_NAME" \
        --profile kind=synchronous \
        --constraint kind=max_requests,count=10 \
        --data kind=synthetic_text,prompt_tokens=64,output_tokens=32 \
        --tokenizer "kind=huggingface_auto,model=$model" \
        --output "kind=json,path=$work/guidellm.json" \
        --disable-console-interactive ;;
    aiperf)
      run aiperf "$VENV/bin/aiperf" profile --model "$MODEL_NAME" --url "$base" \
        --endpoint-type chat --streaming --tokenizer "$model" \
        --request-count 20 --concurrency 4 \
        --synthetic-input-tokens-mean 64 --output-tokens-mean 32 \
        --extra-inputs min_tokens:32 --artifact-dir "$work/aiperf" ;;
    lm-eval)
      run lm-eval "$VENV/bin/lm_eval" --model local-completions \
        --model_args "model=$MODEL_NAME,base_url=$base/v1/completions,tokenizer=$model,tokenized_requests=True,num_concurrent=2,max_retries=1" \
        --include_path scripts/compat --tasks conveyor_mc --batch_size 1 ;;
  esac
done

if [ ${#failed[@]} -gt 0 ]; then
  echo "compat: failed: ${failed[*]}" >&2
  exit 1
fi
echo "compat: all passed: ${tools[*]}"
