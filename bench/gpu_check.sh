#!/usr/bin/env bash
# The one prepared run for a lent GPU: everything the first ~10 minutes on a GPU must answer, inside
# an 8-minute deadline, then a one-screen summary printed last (bench/gpu_summary.py says what it
# covers; this script adds how long each step took against its timeout, and what $OUT holds).
#   here first:  mkdir -p bench/_data && cp ../shared/data/gsm8k/train.jsonl bench/_data/gsm8k_train.jsonl
#   device run:  bash bench/gpu_check.sh            (carry: bench/_data; timeout_s 560)
#   CPU smoke:   bash bench/gpu_check.sh --smoke    (tiny shapes on CPU, same commands: tests/test_bench.py)
#   PPO only:    bash bench/gpu_check.sh --ppo-only (carry: bench/_data; timeout_s 300): the PPO step twice,
#                the first GPU run's settings then the config's; --ppo-only --smoke is its CPU smoke
#
# The GPU machine has `python3` only (no `python`, no `torchrun` promised) and can install nothing:
# every Python runs as $PY (default python3), torchrun as `$PY -m torch.distributed.run`.
#
# What comes back. A device run hands back at most 8 files from $OUT, at most two folders down,
# names of [A-Za-z0-9._-]. So the steps write their logs into a scratch folder, and $OUT holds
# only these 7 files, each written as soon as its step ends (a run cut short keeps what it had):
#   summary.md          the screen printed at the end (+ step times vs timeouts, the file list)
#   summary.json        the same figures as JSON: env, tests, rollout rows, ppo, steps, files
#   logs.tar.gz         every step's log (env, gpu, cuda_tests, rollout, ppo + its metrics.jsonl),
#                       remade after each step; weights (GBs of random init) are never in it
#   env.json            versions and attention backends            (step 1)
#   cuda_tests.log      the CUDA tests' pytest output               (step 2)
#   rollout.md          the rollout table, row by row as measured   (step 3)
#   ppo/summary.json    the PPO run's figures                       (step 4)
# The script checks that count, depth and names at its end (exit 1 if they do not fit, or if a
# step failed); --smoke checks the same on the CPU. --ppo-only leaves 5: summary.md, summary.json,
# logs.tar.gz, ppo_first/summary.json and ppo_config/summary.json.
#
# Timeouts. Each step's timeout is a cap no healthy run comes near (estimated healthy time on one
# H200 in brackets; no GPU has run this yet, so summary.md reports each step's real time against
# its cap): nvidia-smi 20 s [1], env probe 60 s [15], CUDA tests 90 s [30-40: collection + tiny
# models], rollout 180 s [80-100: 0.5B checkpoint, 4 batch processes, the batch-1 floor of the fused
# and the unfused copy], PPO 240 s [100-140: 0.5B setup ~40, 4 steps of 128 x 256 tokens]; about
# 5 minutes in all. The caps sum to more than the deadline on purpose: a step gets at most what is
# left of DEADLINE (470 s) since the start, and one left under 10 s is skipped, so even a run where
# every step hangs prints its summary by ~530 s (deadline, 10 s kill grace, two summary steps of at
# most 20 s + 5 s grace): inside the 560 s device timeout.
#
# --ppo-only: nvidia-smi, then bench/ppo_gpu.py twice on the same data and the same cached weights
# ($WORK/cache: the tokenizer and the bf16 random init are made once, by the first run), 3 steps of
# 128 prompts x 256 response tokens each: step 1 warms up (CUDA graphs, allocator), step 2 is timed,
# step 3 runs under torch.profiler (summary.json is written before it; the run skips it when it would
# not fit the step's timeout, which it reads from $STEP_TIMEOUT_S). Estimated from the first GPU run
# (setup + first step 48 s, 19.8 s a step at the first settings): first ~100 s (setup ~25, warm-up
# ~22, timed ~20, profiled ~30 + analysis), config ~70 s if it is faster as expected. Caps 130 s
# each under a 225 s deadline (the config run gets what is left: >= 84 s), two summary steps of at
# most 10 s: ~190 s when healthy, ~240 s if the PPO runs hang (225 + 10 s kill grace + ~2 s of
# summary), 265 s if the summary steps hang too; inside a 300 s device timeout.
set -uo pipefail
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
OUT=${OUT:-/tmp/nanokl_gpu_check}
SMOKE=0; PPO_ONLY=0
for arg in "$@"; do
  case "$arg" in
    --smoke) SMOKE=1 ;;
    --ppo-only) PPO_ONLY=1 ;;
    *) echo "usage: bash bench/gpu_check.sh [--smoke] [--ppo-only]" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 1  # absolute, before leaving the caller's folder
cd "$(dirname "$0")/.." || exit 1
WORK=$(mktemp -d "${TMPDIR:-/tmp}/nanokl_gpu_check.XXXXXX")  # logs and weights: never under $OUT
trap 'rm -rf "$WORK" "$WORK.tgz"' EXIT
# a rerun into the same $OUT must not report the last run's results as this one's
rm -rf "$OUT/summary.md" "$OUT/summary.json" "$OUT/logs.tar.gz" "$OUT/env.json" "$OUT/cuda_tests.log" \
  "$OUT/rollout.md" "$OUT/ppo/summary.json" "$OUT/ppo_first/summary.json" "$OUT/ppo_config/summary.json"
DATA=bench/_data/gsm8k_train.jsonl
T_FINAL=20  # each of the two summary steps (healthy: ~1 s)
if [ "$PPO_ONLY" = 1 ] && [ "$SMOKE" = 1 ]; then
  MODE=ppo-smoke  # tiny shapes on CPU; the profiler asked for (off by default on CPU) so that it runs here too
  PPO_ARGS=(--shape tiny --device cpu --steps 3 --batch 4 --response 8 --profile on)
  T_PPO=60; DEADLINE=${DEADLINE:-150}; T_FINAL=10
  DATA=${SMOKE_DATA:-$DATA}
elif [ "$PPO_ONLY" = 1 ]; then
  MODE=ppo; PPO_ARGS=(--shape 0.5b --device cuda --steps 3 --batch 128 --response 256)
  T_GPU=20; T_PPO=130; DEADLINE=${DEADLINE:-225}; T_FINAL=10
elif [ "$SMOKE" = 1 ]; then
  MODE=smoke; DEV=cpu; SIZE=tiny; BATCHES=1,4; IMPL_BATCHES=hf=4,nanokl-eager=1,naive=1; NEW=8; ROUNDS=1
  PPO_ARGS=(--shape tiny --device cpu --steps 2 --batch 4 --response 8)
  T_GPU=0; T_ENV=60; T_TESTS=90; T_ROLLOUT=120; T_PPO=150; DEADLINE=${DEADLINE:-400}
  TESTS=(--collect-only)  # on CPU every CUDA test skips: check only that they collect
  DATA=${SMOKE_DATA:-$DATA}  # the tests name their own (present or not), whatever bench/_data holds
else
  MODE=device; DEV=cuda; SIZE=0.5b; BATCHES=1,32,128,256; IMPL_BATCHES=hf=32,nanokl-eager=1,naive=1; NEW=128; ROUNDS=1
  PPO_ARGS=(--shape 0.5b --device cuda --steps 4 --batch 128 --response 256)
  T_GPU=20; T_ENV=60; T_TESTS=90; T_ROLLOUT=180; T_PPO=240; DEADLINE=${DEADLINE:-470}
  TESTS=()
fi
: > "$WORK/steps.tsv"
FAILED=0

publish() {  # after every step: results into $OUT, every log (no weights) into $OUT/logs.tar.gz
  [ -f "$WORK/cuda_tests.log" ] && cp "$WORK/cuda_tests.log" "$OUT/cuda_tests.log"
  local d
  for d in ppo ppo_first ppo_config; do
    if [ -f "$WORK/$d/summary.json" ]; then mkdir -p "$OUT/$d" && cp "$WORK/$d/summary.json" "$OUT/$d/summary.json"; fi
    rm -rf "$WORK/$d/run/checkpoints"  # none expected (save_freq=-1); GBs if any
  done
  # ckpts (rollout) and cache (PPO's tokenizer and GBs of random weights): not worth bringing back
  (cd "$WORK" && find . \( -path ./ckpts -o -path ./cache \) -prune -o -type f -size +8192k -print > left_out.txt
   find . \( -path ./ckpts -o -path ./cache \) -prune -o -type f ! -size +8192k -print0 | tar --null -czf "$WORK.tgz" -T -) \
    && mv -f "$WORK.tgz" "$OUT/logs.tar.gz"
}

# step NAME CAP CMD...: CMD's output to $WORK/NAME.log, under a timeout of CAP seconds or what is
# left of the deadline, whichever is less; its exit status and seconds go to steps.tsv
step() {
  local name=$1 cap=$2 t; shift 2
  t=$(( DEADLINE - SECONDS < cap ? DEADLINE - SECONDS : cap ))
  if (( t < 10 )); then
    echo "skipped: $((DEADLINE - SECONDS)) s left of the $DEADLINE s deadline" > "$WORK/$name.log"
    printf '%s\tskipped\t0\t%s\n' "$name" "$cap" >> "$WORK/steps.tsv"; FAILED=1
    echo "[$SECONDS s] $name: skipped (deadline)"; publish; return
  fi
  local t0=$SECONDS rc
  STEP_TIMEOUT_S=$t timeout -k 10 "$t" "$@" > "$WORK/$name.log" 2>&1  # ppo_gpu.py reads it (--time-limit)
  rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$t" >> "$WORK/steps.tsv"
  (( rc == 0 )) || FAILED=1
  echo "[$SECONDS s] $name: exit $rc in $((SECONDS - t0)) s (timeout $t s)$( ((rc == 124 || rc == 137)) && echo ': TIMED OUT')"
  publish
}

if [ "$PPO_ONLY" = 1 ]; then
  # the PPO step only, twice: the first GPU run's settings, then the config's; same data, same cache
  [ "$MODE" = ppo ] && step gpu "$T_GPU" nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  for settings in first config; do
    if [ -f "$DATA" ]; then
      step "ppo_$settings" "$T_PPO" "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 bench/ppo_gpu.py \
        --data "$DATA" --out "$WORK/ppo_$settings" --cache "$WORK/cache" --settings "$settings" "${PPO_ARGS[@]}"
    else
      echo "no $DATA: copy GSM8K's train.jsonl there (see the header)" > "$WORK/ppo_$settings.log"
      printf 'ppo_%s\tno data\t0\t%s\n' "$settings" "$T_PPO" >> "$WORK/steps.tsv"; FAILED=1; publish
    fi
  done
  SUMMARY=compare
else
SUMMARY=summary
# 0. the GPU as the driver sees it
if [ "$MODE" = device ]; then
  step gpu "$T_GPU" nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
fi

# 1. versions and attention backends (which fused SDPA kernels take a mask, with and without GQA)
step env "$T_ENV" "$PY" bench/gpu_summary.py env "$OUT/env.json"

# 2. CUDA tests: graph replay vs eager (teacher-forced in bf16), weight updates seen by the graph, ...
step cuda_tests "$T_TESTS" "$PY" -m pytest -q -m cuda tests/ -p no:cacheprovider "${TESTS[@]}"

# 3. rollout, on the fused rollout copy training samples with: batch 1 with and without graphs vs the
#    bandwidth floor (+ kernels per replay; the unfused model as a second line), tokens/s at batch
#    32/128/256 with graphs, HF generate at batch 32; rows land in rollout.md as measured
step rollout "$T_ROLLOUT" "$PY" bench/rollout.py --device "$DEV" --sizes "$SIZE" --batches "$BATCHES" \
  --impls nanokl,nanokl-eager,hf --impl-batches "$IMPL_BATCHES" --new-tokens "$NEW" --rounds "$ROUNDS" \
  --memory off --ckpt-dir "$WORK/ckpts" --out "$OUT/rollout.md"

# 4. PPO end to end under torchrun at world size 1: the fsdp2 config really shards (one shard),
#    GSM8K prompts, Qwen2.5-0.5B-shaped random init, no checkpoint (trainer.save_freq=-1)
if [ -f "$DATA" ]; then
  step ppo "$T_PPO" "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 bench/ppo_gpu.py \
    --data "$DATA" --out "$WORK/ppo" --cache "$WORK/cache" "${PPO_ARGS[@]}"
else
  echo "no $DATA: copy GSM8K's train.jsonl there (see the header)" > "$WORK/ppo.log"
  printf 'ppo\tno data\t0\t%s\n' "$T_PPO" >> "$WORK/steps.tsv"; FAILED=1; publish
fi
fi

# 5. one screen: bench/gpu_summary.py's, then step times, summary.json and what $OUT holds
timeout -k 5 "$T_FINAL" "$PY" bench/gpu_summary.py "$SUMMARY" "$OUT" > "$WORK/summary.log" 2>&1 \
  || echo "bench/gpu_summary.py $SUMMARY failed: see summary.log in logs.tar.gz" >> "$OUT/summary.md"
publish
timeout -k 5 "$T_FINAL" "$PY" - "$OUT" "$WORK/steps.tsv" "$MODE" "$SECONDS" "$DEADLINE" <<'EOF'
"""summary.json, the step times and the check of what $OUT holds; exit 1 when it would not all come back."""
import json
import re
import sys
from pathlib import Path

out, steps_tsv, mode, seconds, deadline = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], *map(int, sys.argv[4:])
MAX_FILES, MAX_DEPTH, MAX_BYTES, NAME = 8, 2, 16 << 20, re.compile(r"[A-Za-z0-9._-]+")


def read_json(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


steps = []
for line in steps_tsv.read_text().splitlines():
    name, rc, secs, cap = line.split("\t")
    steps.append(dict(step=name, rc=int(rc) if rc.lstrip("-").isdigit() else rc, seconds=int(secs), timeout_s=int(cap)))
rollout = out / "rollout.md"
text = rollout.read_text() if rollout.exists() else ""
rows = [json.loads(ln) for ln in text.split("```")[1].strip().splitlines()] if text.count("```") >= 2 else None
tests = out / "cuda_tests.log"
tests_line = next((ln.strip("= ") for ln in reversed(tests.read_text().splitlines())
                   if re.search(r"\d+ (passed|failed|skipped|error)|tests? collected|no tests ran", ln)), None) \
    if tests.exists() else None
files = sorted({str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()} | {"summary.json"})
problems = [f for f in files if f.count("/") > MAX_DEPTH or not all(NAME.fullmatch(part) for part in f.split("/"))]
big = [f for f in files if f != "summary.json" and (out / f).stat().st_size > MAX_BYTES]
fits = len(files) <= MAX_FILES and not problems and not big
summary = dict(mode=mode, wall_s=seconds, deadline_s=deadline, steps=steps, env=read_json(out / "env.json"),
               cuda_tests=tests_line, rollout=rows, ppo=read_json(out / "ppo" / "summary.json"),
               **{r: read_json(out / r / "summary.json") for r in ("ppo_first", "ppo_config") if mode.startswith("ppo")},
               files=files, files_fit=fits)
(out / "summary.json").write_text(json.dumps(summary, indent=1))
lines = ["steps (seconds of timeout, exit): " + "; ".join(
             f"{s['step']} {s['seconds']} of {s['timeout_s']} s, "
             + ("TIMED OUT" if s["rc"] in (124, 137) else f"exit {s['rc']}" if isinstance(s["rc"], int) else s["rc"])
             for s in steps)
         + f"; {seconds} s in all (deadline {deadline} s)",
         f"$OUT holds {len(files)} files (at most {MAX_FILES} come back): {', '.join(files)}"]
if not fits:
    lines.append(f"DOES NOT FIT: {len(files)} files; too deep or odd names: {problems}; over 16 MiB: {big}")
with open(out / "summary.md", "a") as f:
    f.write("\n".join(lines) + "\n")
sys.exit(0 if fits else 1)
EOF
FIT=$?
cat "$OUT/summary.md"  # printed last
[ "$FIT" = 0 ] && [ "$FAILED" = 0 ]
