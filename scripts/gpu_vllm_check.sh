#!/usr/bin/env bash
# The connector on a GPU machine that has vLLM (a CUDA build, 0.32) installed beside this package:
# the real-vLLM tests (tensor parallel 2 where there are two GPUs), then a short bench-vllm (eager, 4 MuSiQue prompts). Writes $OUT/.
#   OUT=results/gpu/vllm bash scripts/gpu_vllm_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu/vllm}
PY=${PY:-python}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
$PY -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__, torch.cuda.is_available())' \
    | tee -a "$OUT/gpu.txt"
$PY -m pytest -q tests/test_vllm_connector.py tests/test_vllm_serve.py \
    tests/test_vllm_tensor_parallel.py 2>&1 | tee "$OUT/pytest.log"
$PY -m cachetune.cli bench-vllm --data musique --limit 4 --enforce-eager --json "$OUT/bench_vllm.json" 2>&1 \
    | tail -20 | tee "$OUT/bench_vllm.log"
