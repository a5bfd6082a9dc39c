#!/usr/bin/env bash
# The one prepared run for a lent GPU: everything the first ~10 minutes on a GPU must answer, in
# at most 8 minutes, each result written to $OUT as soon as it is measured, then a one-screen
# summary ($OUT/summary.md, printed last; bench/gpu_summary.py says what it covers).
#   here first:  mkdir -p bench/_data && cp ../shared/data/gsm8k/train.jsonl bench/_data/gsm8k_train.jsonl
#   device run:  bash bench/gpu_check.sh            (carry: bench/_data; timeout_s 540)
#   CPU smoke:   bash bench/gpu_check.sh --smoke    (tiny shapes on CPU, same flags: tests/test_bench.py)
# Time budget (the timeouts below sum to 450 s, plus ~20 s of probes): CUDA tests 90 s, rollout
# benchmark 150 s, PPO under torchrun 200 s.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/nanokl_gpu_check}
mkdir -p "$OUT"
DATA=bench/_data/gsm8k_train.jsonl
if [ "${1:-}" = "--smoke" ]; then
  DEV=cpu; SIZE=tiny; BATCHES=1,4; IMPL_BATCHES=hf=4,nanokl-eager=1,naive=1; NEW=8; ROUNDS=1
  PPO_ARGS=(--shape tiny --device cpu --steps 2 --batch 4 --response 8)
  T_TESTS=60; T_ROLLOUT=60; T_PPO=120
  TESTS=(--collect-only)  # on CPU every CUDA test skips: check only that they collect
  [ -f "$DATA" ] || DATA=${SMOKE_DATA:-$DATA}
else
  DEV=cuda; SIZE=0.5b; BATCHES=1,32,128,256; IMPL_BATCHES=hf=32,nanokl-eager=1,naive=1; NEW=128; ROUNDS=1
  PPO_ARGS=(--shape 0.5b --device cuda --steps 4 --batch 128 --response 256)
  T_TESTS=90; T_ROLLOUT=150; T_PPO=200
  TESTS=()
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
fi

# 0. versions and attention backends (which fused SDPA kernels take a mask, with and without GQA)
python bench/gpu_summary.py env "$OUT/env.json" > "$OUT/env.log" 2>&1

# 1. CUDA tests: graph replay vs eager (teacher-forced in bf16), weight updates seen by the graph, ...
timeout "$T_TESTS" python -m pytest -q -m cuda tests/ -p no:cacheprovider "${TESTS[@]}" > "$OUT/cuda_tests.log" 2>&1

# 2. rollout: batch 1 with and without graphs vs the bandwidth floor (+ kernels per replay), tokens/s
#    at batch 32/128/256 with graphs, HF generate at batch 32; rows land in rollout.md as measured
timeout "$T_ROLLOUT" python bench/rollout.py --device "$DEV" --sizes "$SIZE" --batches "$BATCHES" \
  --impls nanokl,nanokl-eager,hf --impl-batches "$IMPL_BATCHES" --new-tokens "$NEW" --rounds "$ROUNDS" \
  --memory off --out "$OUT/rollout.md" > "$OUT/rollout.log" 2>&1

# 3. PPO end to end under torchrun at world size 1: the fsdp2 config really shards (one shard),
#    GSM8K prompts, Qwen2.5-0.5B-shaped random init; summary.json has the step's figures
if [ -f "$DATA" ]; then
  timeout "$T_PPO" torchrun --standalone --nproc_per_node=1 bench/ppo_gpu.py --data "$DATA" --out "$OUT/ppo" \
    "${PPO_ARGS[@]}" > "$OUT/ppo.log" 2>&1
  rm -rf "$OUT/ppo/model" "$OUT/ppo/run/checkpoints"  # GBs of random weights: not worth bringing back
else
  echo "no $DATA: copy GSM8K's train.jsonl there (see the header)" > "$OUT/ppo.log"
fi

# 4. one screen
python bench/gpu_summary.py summary "$OUT"
