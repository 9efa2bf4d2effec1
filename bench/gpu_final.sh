#!/usr/bin/env bash
# The evidence run on the lent H200, in two parts (each fits one 10-minute device call):
#   bash bench/gpu_final.sh tests   GPU tests (Hypothesis profile gpu), the demo, compute-sanitizer memcheck
#   bash bench/gpu_final.sh racecheck   racecheck alone, with a longer limit (the float64
#                                   generic backward is slow under it)
#   bash bench/gpu_final.sh bench   forward benchmark against the peers (cuflash = the dispatcher's
#                                   choice, cuflash_sm80 = the mma.sync kernel), float32 against
#                                   naive CuPy, memory mode, and fwd+bwd against the peers
#   bash bench/gpu_final.sh bwd     fwd+bwd against the peers (cuflash_sm80 = fwd_sm80 + bwd_sm80)
#                                   and the cost of deterministic=True
# Files land in $OUT. Run from the repository root.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=gpu
part=${1:-tests}
if [ "$part" = tests ]; then
  T="$OUT/tests.txt" S="$OUT/sanitizer.txt"
  { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
    python3 -m cuflash info; } > "$T" 2>&1
  echo "== forward GPU tests" >> "$T"
  timeout -s INT 330 python3 -m pytest -m gpu -p no:cacheprovider -q --tb=short \
    --ignore=tests/test_gpu_backward.py >> "$T" 2>&1; echo "pytest exit $?" >> "$T"
  echo "== backward GPU tests" >> "$T"
  timeout -s INT 200 python3 -m pytest -m gpu -p no:cacheprovider -q --tb=short \
    tests/test_gpu_backward.py >> "$T" 2>&1; echo "pytest exit $?" >> "$T"
  echo "== demo" >> "$T"; timeout 40 python3 -m cuflash demo >> "$T" 2>&1; echo "demo exit $?" >> "$T"
  # racecheck has its own part (it needs more than this call has left)
  echo "== memcheck" >> "$S"
  timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 python3 bench/sanitize_smoke.py >> "$S" 2>&1
  echo "exit $?" >> "$S"
  grep -E "passed|failed|exit" "$T"; grep -E "^==|exit|ERROR SUMMARY|hazard" "$S"
elif [ "$part" = racecheck ]; then
  S="$OUT/racecheck.txt"
  timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 python3 bench/sanitize_smoke.py > "$S" 2>&1
  echo "exit $?" >> "$S"; tail -n 5 "$S"
elif [ "$part" = bench ]; then
  L="$OUT/bench.txt"
  B="--mode fwd --budget 0.25"
  timeout 200 python3 -m cuflash bench --dtype bf16,fp16 --impl cuflash,cuflash_sm80,sdpa_flash,sdpa_cudnn $B \
    --json "$OUT/fwd_bf16_fp16.json" > "$L" 2>&1
  timeout 40 python3 -m cuflash bench --dtype fp32 --d 64,128 --L 1024,4096 --causal false \
    --impl cuflash,naive_cupy $B --json "$OUT/fwd_fp32.json" >> "$L" 2>&1
  timeout 45 python3 -m cuflash bench --memory --impl cuflash,naive_cupy,sdpa_flash --dtype bf16 \
    --json "$OUT/memory.json" >> "$L" 2>&1
  timeout 200 python3 -m cuflash bench --mode fwd_bwd --dtype bf16 --d 64,128 \
    --impl cuflash,sdpa_flash,sdpa_cudnn --budget 0.25 --json "$OUT/fwd_bwd_bf16.json" >> "$L" 2>&1
  grep -B2 -A40 "^TFLOP/s" "$L" | head -n 140
  grep -iE "peak|memory" "$L" | tail -n 14
else   # bwd: the backward's evidence alone (forward kernels unchanged: tools/sass_identity.py)
  L="$OUT/bwd.txt"
  timeout 260 python3 -m cuflash bench --mode fwd_bwd --dtype bf16 --d 64,128 \
    --impl cuflash,cuflash_sm80,sdpa_flash,sdpa_cudnn --budget 0.25 --json "$OUT/fwd_bwd_bf16.json" > "$L" 2>&1
  timeout 120 python3 bench/bwd_deterministic_cost.py > "$OUT/bwd_deterministic_cost.txt" 2>&1
  grep -B2 -A16 "^TFLOP/s" "$L"; cat "$OUT/bwd_deterministic_cost.txt"
fi
