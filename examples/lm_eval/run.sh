#!/usr/bin/env bash
# Run lm-evaluation-harness's `local-completions` model on the task cachetune_musique_mc against
# `cachetune serve --method METHOD`, and write lm-eval's results JSON under $OUT_DIR/METHOD/.
#
#   examples/lm_eval/run.sh full_recompute
#   examples/lm_eval/run.sh cachetune
#
# Every step is a command a user would type; the script echoes each one before running it:
#   1. (once) a HF tokenizer folder for lm-eval, saved from the bundled model (SmolLM2-135M-Instruct, GGUF)
#   2. (once) the task's data: python examples/lm_eval/build_task.py
#   3. cachetune serve --method METHOD on 127.0.0.1:$PORT, in the background (skipped with SERVER_URL=...)
#   4. POST /v1/documents with every document of the task (register_documents.py)
#   5. lm_eval --model local-completions ... --tasks cachetune_musique_mc --include_path examples/lm_eval
#   6. stop the server started in step 3 (by its pid)
#
# Environment (defaults in brackets):
#   CACHETUNE   the cachetune command [.venv/bin/cachetune of this repo]
#   PYTHON      a Python with the project installed, for step 1 [.venv/bin/python of this repo]
#   LM_EVAL     the lm_eval command, from a separate venv [/tmp/lmeval/bin/lm_eval]
#               (python3 -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install "lm_eval[api]" transformers)
#   TOKENIZER   HF tokenizer folder [/tmp/smollm2-tokenizer]
#   PORT        [8000]          SERVER_URL  use this running server instead of starting one [unset]
#   OUT_DIR     [results/lm_eval]   LIMIT  lm_eval --limit (items), for a quick try [unset: all 20]
#   BATCH_SIZE  prompts per request [4]   SERVE_ARGS  more `cachetune serve` flags, e.g. "--threads 2" [unset]
#   CACHETUNE_API_KEY / OPENAI_API_KEY: when the server has --api-key, lm-eval sends OPENAI_API_KEY.
set -euo pipefail

METHOD="${1:?usage: run.sh METHOD   (e.g. full_recompute or cachetune)}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
CACHETUNE="${CACHETUNE:-$REPO/.venv/bin/cachetune}"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
LM_EVAL="${LM_EVAL:-/tmp/lmeval/bin/lm_eval}"
TOKENIZER="${TOKENIZER:-/tmp/smollm2-tokenizer}"
PORT="${PORT:-8000}"
OUT_DIR="${OUT_DIR:-$REPO/results/lm_eval}"
BATCH_SIZE="${BATCH_SIZE:-4}"
MODEL_NAME="smollm2-135m"   # the server's model id (GET /v1/models); lm-eval sends it as "model"
export OPENAI_API_KEY="${OPENAI_API_KEY:-${CACHETUNE_API_KEY:-}}"

say() { printf '+ %s\n' "$*" >&2; }

# 1. tokenizer folder (lm-eval's loglikelihood needs a local tokenizer to split context and continuation)
if [[ ! -f "$TOKENIZER/tokenizer.json" ]]; then
  say "$PYTHON -c 'from cachetune.model.loader import load_model; load_model(\"smollm2-135m\").tokenizer.save_pretrained(\"$TOKENIZER\")'"
  "$PYTHON" -c "from cachetune.model.loader import load_model; load_model('smollm2-135m').tokenizer.save_pretrained('$TOKENIZER')"
fi

# 2. task data
if [[ ! -f "$HERE/musique_mc.jsonl" ]]; then
  say python3 "$HERE/build_task.py"
  python3 "$HERE/build_task.py"
fi

# 3. server
SERVER_PID=""
stop_server() {
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    say kill "$SERVER_PID"
    kill "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null || true
  fi
}
trap stop_server EXIT
mkdir -p "$OUT_DIR/$METHOD"
if [[ -n "${SERVER_URL:-}" ]]; then
  ROOT="${SERVER_URL%/}"
  echo "using the running server at $ROOT (it must serve --method $METHOD)" >&2
else
  ROOT="http://127.0.0.1:$PORT"
  # shellcheck disable=SC2086
  say "$CACHETUNE" serve --method "$METHOD" --host 127.0.0.1 --port "$PORT" ${SERVE_ARGS:-} "> $OUT_DIR/$METHOD/serve.log 2>&1 &"
  # shellcheck disable=SC2086
  "$CACHETUNE" serve --method "$METHOD" --host 127.0.0.1 --port "$PORT" ${SERVE_ARGS:-} >"$OUT_DIR/$METHOD/serve.log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 600); do   # model load + start-up self-check: up to 10 minutes on a busy CPU
    curl -sf "$ROOT/health" >/dev/null 2>&1 && break
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "the server exited; see $OUT_DIR/$METHOD/serve.log" >&2; exit 1; }
    sleep 1
  done
  curl -sf "$ROOT/health" >/dev/null || { echo "the server did not come up; see $OUT_DIR/$METHOD/serve.log" >&2; exit 1; }
fi

# 4. register the task's documents (their KV is cached; the server finds them inside the prompts)
say python3 "$HERE/register_documents.py" --url "$ROOT" --out "$OUT_DIR/$METHOD/documents.json"
python3 "$HERE/register_documents.py" --url "$ROOT" --out "$OUT_DIR/$METHOD/documents.json"

# 5. lm-eval
MODEL_ARGS="model=$MODEL_NAME,base_url=$ROOT/v1/completions,tokenizer=$TOKENIZER,tokenizer_backend=huggingface"
MODEL_ARGS+=",tokenized_requests=True,num_concurrent=1,max_retries=1,max_length=8192,timeout=1800"
CMD=("$LM_EVAL" --model local-completions --model_args "$MODEL_ARGS"
     --tasks cachetune_musique_mc --include_path "$HERE" --batch_size "$BATCH_SIZE"
     --output_path "$OUT_DIR/$METHOD" --log_samples)
[[ -n "${LIMIT:-}" ]] && CMD+=(--limit "$LIMIT")
say "${CMD[@]}"
"${CMD[@]}"
# 6. (trap) stop the server this script started
echo "results: $(find "$OUT_DIR/$METHOD" -name 'results_*.json' -newer "$OUT_DIR/$METHOD/documents.json" | sort | tail -1)" >&2
