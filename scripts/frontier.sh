#!/bin/bash
# KL and F1 against TTFT across r for every method, per model and set (resumable).
# Examples are added in passes (10, 25, 50, 100 per set), so an interrupted run has every set
# covered to the same depth; each pass resumes from the progress files and rewrites the reports.
# The whole sweep of ratios runs on each set's first SWEEP examples; past them, only r = 0.15 (the
# bars' ratio) and the methods without a budget, so the r = 0.15 comparison gets every example.
#   scripts/frontier.sh smollm2            SmolLM2-135M float32, 100 examples per set
#   scripts/frontier.sh qwen               Qwen2.5-Coder-1.5B float32, 50 examples per set
# METHODS=m1,m2,... runs those methods only, and OUT=DIR writes elsewhere: a pass that takes some
# methods past the others' examples, in a copy of the progress files (the report covers the methods
# a run names, so the frontier's own report keeps every method).
set -euo pipefail
cd "$(dirname "$0")/.."
CT=${CT:-.venv/bin/cachetune}
RATIOS=0.05,0.1,0.15,0.2,0.3
SETS=${SETS:-hotpotqa_heldout musique 2wikimqa}
# The methods are named in full in one file, shared with the GPU check. The first pass's uncapped
# and deeper question variants stay in the progress files but are no longer extended.
source scripts/selection_methods.sh
case "${1:-smollm2}" in
  # SmolLM2 also has the trained methods (their weights ship for it).
  smollm2) MODEL=(); OUT=${OUT:-results/smollm2/frontier}; PASSES=${PASSES:-10 25 50 100}; SWEEP=${SWEEP:-25}
           METHODS=${METHODS:-$BAR_METHODS,c2kv,kvlink,block_attention} ;;
  # Qwen: about 10x the compute per token; the methods the bars name.
  qwen)    MODEL=(--model qwen2.5-coder-1.5b); OUT=${OUT:-results/qwen/frontier}; PASSES=${PASSES:-10 25 50}; SWEEP=${SWEEP:-10}
           METHODS=${METHODS:-$BAR_METHODS} ;;
  *) echo "usage: $0 smollm2|qwen" >&2; exit 2 ;;
esac
for limit in $PASSES; do
  for set in $SETS; do
    # A method added to recorded examples is timed beside `first` run again (the bar's TTFT reference).
    # --deep-within 0: the named methods mean what they spell (the files began before deep focus was on
    # by default); a method that takes deep focus names it ("$FOCUS:deep_within=0.08").
    "$CT" eval "${MODEL[@]}" --threads 2 --data "$set" --limit "$limit" --methods "$METHODS" --retime "$FIRST" \
      --deep-within 0 \
      --ratios "$RATIOS" --sweep-examples "$SWEEP" --json "$OUT/eval_$set.json" --plots "$OUT/$set"
  done
done
