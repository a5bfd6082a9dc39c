#!/usr/bin/env bash
# One prepared run for a lent GPU (see DEVELOPERS notes: ~15 min of device time per session).
# Runs the CUDA tests, then the rollout benchmark, and leaves logs and tables in $OUT.
#   device run:  bash bench/gpu_check.sh            (timeout_s ~ 540)
set -uo pipefail
OUT=${OUT:-/tmp/nanokl_gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"

# 1. CUDA tests (graph replay == eager, weight updates seen by the graph), ~1 min
timeout 180 python -m pytest -q -m cuda tests/ -p no:cacheprovider 2>&1 | tee "$OUT/cuda_tests.log"

# 2. rollout benchmark: 4M / 25M / 0.5B-shaped, batch 1..256, graphs on/off, naive, HF; ~5 min
timeout 360 python bench/rollout.py --device cuda --repeats 2 --out "$OUT/rollout_gpu.md" 2>&1 | tee "$OUT/rollout_gpu.log"
echo "done: $(ls "$OUT")"
