#!/usr/bin/env bash
# GPU smoke test: a real SGLang server with a small model, the rollbus edge in front of it, a short
# multi-turn agent load sent both ways; reports tokens/s and the edge's added latency per turn.
#
# Usage: ops/bench/gpu_smoke.sh MODEL_DIR [OUT_DIR]
#   MODEL_DIR  a local Hugging Face model directory SGLang can serve (nothing is downloaded), e.g. a
#              Qwen2.5-0.5B-Instruct checkout. The edge's tokenizer is MODEL_DIR itself when it holds
#              tokenizer.json + tokenizer_config.json, else builtin:qwen2.5 (override: TOKENIZER=...).
#   OUT_DIR    logs and the rollbus data dir [./gpu-smoke-out]
# Needs: a GPU, `pip install sglang` in this Python, and rollbus installed (pip install -e .).
# Knobs (environment): SESSIONS=16 TURNS=4 MAX_TOKENS=128 SGLANG_PORT=30000 EDGE_PORT=8000
#   STARTUP_TIMEOUT=600 (seconds for SGLang to load) LOAD_TIMEOUT=900 (seconds for the whole load)
#   SGLANG_URL=http://host:port  use a running SGLang server instead of starting one
#   SGLANG_ARGS="..."            extra arguments for sglang.launch_server (e.g. "--mem-fraction-static 0.5")
set -euo pipefail

MODEL_DIR=${1:?"usage: $0 MODEL_DIR [OUT_DIR]   (see the header of this script)"}
OUT_DIR=${2:-gpu-smoke-out}
PYTHON=${PYTHON:-python}
SESSIONS=${SESSIONS:-16}
TURNS=${TURNS:-4}
MAX_TOKENS=${MAX_TOKENS:-128}
SGLANG_PORT=${SGLANG_PORT:-30000}
EDGE_PORT=${EDGE_PORT:-8000}
STARTUP_TIMEOUT=${STARTUP_TIMEOUT:-600}
LOAD_TIMEOUT=${LOAD_TIMEOUT:-900}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
ADMIN_TOKEN=gpu-smoke-$$

if [[ -z "${TOKENIZER:-}" ]]; then
  if [[ -f "$MODEL_DIR/tokenizer.json" && -f "$MODEL_DIR/tokenizer_config.json" ]]; then
    TOKENIZER=$MODEL_DIR
  else
    TOKENIZER=builtin:qwen2.5
  fi
fi

mkdir -p "$OUT_DIR"
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT INT TERM

wait_for() {  # URL SECONDS WHAT
  local deadline=$((SECONDS + $2))
  until curl -fsS -o /dev/null "$1" 2>/dev/null; do
    if ((SECONDS > deadline)); then echo "gpu_smoke: $3 did not come up within $2 s (see $OUT_DIR)" >&2; exit 1; fi
    sleep 2
  done
}

echo "gpu_smoke: model=$MODEL_DIR tokenizer=$TOKENIZER sessions=$SESSIONS turns=$TURNS max_tokens=$MAX_TOKENS"
if [[ -n "${SGLANG_URL:-}" ]]; then
  echo "gpu_smoke: using the SGLang server at $SGLANG_URL"
else
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  "$PYTHON" -c "import sglang" 2>/dev/null || { echo "gpu_smoke: sglang is not installed (pip install sglang)" >&2; exit 2; }
  SGLANG_URL=http://127.0.0.1:$SGLANG_PORT
  # shellcheck disable=SC2086
  "$PYTHON" -m sglang.launch_server --model-path "$MODEL_DIR" --host 127.0.0.1 --port "$SGLANG_PORT" \
    ${SGLANG_ARGS:-} >"$OUT_DIR/sglang.log" 2>&1 &
  PIDS+=($!)
  echo "gpu_smoke: starting SGLang (log: $OUT_DIR/sglang.log) ..."
fi
wait_for "$SGLANG_URL/health" "$STARTUP_TIMEOUT" "SGLang"

PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m rollbus.cli up --port "$EDGE_PORT" \
  --data-dir "$OUT_DIR/data" --admin-token "$ADMIN_TOKEN" --engine sglang --engine-url "$SGLANG_URL" \
  --tokenizer "$TOKENIZER" --log-level WARNING >"$OUT_DIR/rollbus.log" 2>&1 &
PIDS+=($!)
wait_for "http://127.0.0.1:$EDGE_PORT/healthz" 120 "rollbus up"
echo "gpu_smoke: rollbus edge at http://127.0.0.1:$EDGE_PORT (log: $OUT_DIR/rollbus.log)"

timeout "$LOAD_TIMEOUT" "$PYTHON" "$HERE/gpu_smoke.py" --edge "http://127.0.0.1:$EDGE_PORT" \
  --admin-token "$ADMIN_TOKEN" --sglang "$SGLANG_URL" --tokenizer "$TOKENIZER" \
  --sessions "$SESSIONS" --turns "$TURNS" --max-tokens "$MAX_TOKENS" | tee "$OUT_DIR/report.txt"
echo "gpu_smoke: report in $OUT_DIR/report.txt; trajectories under $OUT_DIR/data/trajectories/"
