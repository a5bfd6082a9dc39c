#!/usr/bin/env bash
# One prepared run for a lent GPU (see DEVELOPERS notes: ~15 min of device time per session).
# Runs the CUDA tests, the rollout benchmark and a PPO run, and leaves logs and tables in $OUT.
#   here:        mkdir -p bench/_data && cp ../shared/data/gsm8k/train.jsonl bench/_data/gsm8k_train.jsonl
#   device run:  bash bench/gpu_check.sh   (carry: bench/_data; timeout_s ~ 590)
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
timeout 240 python bench/rollout.py --device cuda --repeats 1 --out "$OUT/rollout_gpu.md" 2>&1 | tee "$OUT/rollout_gpu.log"
# 3. PPO end to end on one GPU: GSM8K prompts, Qwen2.5-0.5B-shaped random init, the fsdp2 config at world size 1 (one shard), ~3 min.
#    The GSM8K file lives outside the repo: copy it to bench/_data/ (git-ignored) and carry it.
if [ -f bench/_data/gsm8k_train.jsonl ]; then
  timeout 300 python bench/ppo_gpu.py --data bench/_data/gsm8k_train.jsonl --out "$OUT/ppo" 2>&1 \
    | grep -v "^ppo:" | tee "$OUT/ppo_gpu.log"
  rm -rf "$OUT/ppo/model" "$OUT/ppo/run/checkpoints"  # GBs of random weights: not worth bringing back
fi
echo "done: $(ls "$OUT")"
