#!/usr/bin/env bash
# The device check, prepared to run once on a lent CUDA machine (see ../shared/gpu/README.md):
#   run(command="source .whl/setup.sh && bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540)
# Side by side in one process each: recipe eager, recipe graph (compiled decode step) and
# transformers generate() on the Qwen3-1.7B shape in bf16 (random weights), then the 27.7M llama;
# each against the memory-read limit measured in the same run. JSON and logs go to $OUT.
# On CPU, a smoke run of the same script: DEVICE=cpu LAYERS=2 OUT=/tmp/out bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
DEVICE=${DEVICE:-cuda}
LAYERS=${LAYERS:+--layers $LAYERS}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" | tee "$OUT/env.txt"
$PY scripts/bench_recipe.py --device "$DEVICE" --preset qwen3-1.7b $LAYERS --new-tokens 64 --repeats 3 \
    --json "$OUT/bench_qwen3_1.7b.json" 2>&1 | grep -v "it/s]" | tee "$OUT/bench_qwen3_1.7b.txt"
$PY scripts/bench_recipe.py --device "$DEVICE" --new-tokens 64 --repeats 3 \
    --json "$OUT/bench_llama_27m.json" 2>&1 | grep -v "it/s]" | tee "$OUT/bench_llama_27m.txt"
