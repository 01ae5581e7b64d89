#!/usr/bin/env bash
# The same Poisson workload against three servers, one at a time on this machine: vLLM alone (prefix
# caching on, documents as text), vLLM with the cachetune connector (`cachetune vllm-serve`, documents
# named in kv_transfer_params) and the standalone `cachetune serve`. Each writes
# $OUT/<arm>/bench_serve.{json,md} and ttft_vs_rate.png; a finished arm is skipped (delete it to rerun).
# Then one table and plot of all three: $OUT/all.{md,png}.
#
#   DATA=musique DOCS=0 RATES=0.1,0.2,0.3,0.5,0.8 bash scripts/bench_serve_vllm.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
OUT=${OUT:-results/vllm/serve_${DATA:-musique}}
DATA=${DATA:-musique}
DOCS=${DOCS:-0}
PROMPTS=${PROMPTS:-8}
RATES=${RATES:-0.1,0.2,0.3,0.5,0.8}
REQUESTS=${REQUESTS:-6}
SLO_MS=${SLO_MS:-10000}
THREADS=${THREADS:-2}
PORT=${PORT:-8021}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-$((THREADS - 1))}
export VLLM_CPU_NUM_OF_RESERVED_CPU=${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}
VLLM_ARGS=(--dtype float32 --max-model-len 8192 --kv-cache-memory-bytes $((4 << 30)))
MODEL=$($BIN/python -c 'from cachetune.vllm import model_dir; print(model_dir())')

bench() {  # arm, documents-as, method: the workload against the server on $PORT
    $BIN/cachetune bench-serve --wait 600 --url "http://127.0.0.1:$PORT" --methods "$3" --documents-as "$2" \
        --rates "$RATES" --requests-per-rate "$REQUESTS" --max-seconds 240 --slo-ms "$SLO_MS" \
        --slo-percentile 90 --max-tokens 16 --data "$DATA" --docs "$DOCS" --prompts "$PROMPTS" --out "$OUT/$1"
}

run_arm() {  # arm, documents-as, method, server command...
    local arm=$1 mode=$2 method=$3
    shift 3
    if [ -f "$OUT/$arm/bench_serve.json" ]; then echo "$arm: done already"; return; fi
    mkdir -p "$OUT/$arm"
    setsid "$@" >"$OUT/$arm/server.log" 2>&1 &
    local pid=$!
    trap "kill -- -$pid 2>/dev/null || true" EXIT
    bench "$arm" "$mode" "$method"
    kill -- -"$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    trap - EXIT
}

run_arm vllm text vllm \
    $BIN/python -m vllm.entrypoints.launchers.api_server.entry --model "$MODEL" --port "$PORT" \
    --enable-prefix-caching --enable-prompt-tokens-details "${VLLM_ARGS[@]}"
run_arm vllm_cachetune kv_transfer_params cachetune \
    $BIN/cachetune vllm-serve --port "$PORT" --tiers cpu:4GiB -- "${VLLM_ARGS[@]}"
run_arm cachetune ids cachetune \
    $BIN/cachetune serve --port "$PORT" --threads "$THREADS" --log-level warning
$BIN/cachetune bench-serve --combine "$OUT" --arms vllm,vllm_cachetune,cachetune
