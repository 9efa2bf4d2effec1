#!/usr/bin/env bash
# The evidence run on the lent H200: GPU tests (Hypothesis profile gpu), the demo,
# compute-sanitizer, the forward benchmark against the peers, float32 against naive CuPy, and
# memory mode. Six files land in $OUT. Run from the repository root: bash bench/gpu_final.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=gpu
T="$OUT/tests.txt" L="$OUT/bench.txt" S="$OUT/sanitizer.txt"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -m cuflash info; } > "$T" 2>&1
echo "== forward GPU tests" >> "$T"
timeout -s INT 240 python3 -m pytest -m gpu -p no:cacheprovider -q --tb=short \
  --ignore=tests/test_gpu_backward.py >> "$T" 2>&1; echo "pytest exit $?" >> "$T"
if [ -f tests/test_gpu_backward.py ]; then
  echo "== backward GPU tests" >> "$T"
  timeout -s INT 120 python3 -m pytest -m gpu -p no:cacheprovider -q --tb=short \
    tests/test_gpu_backward.py >> "$T" 2>&1; echo "pytest exit $?" >> "$T"
fi
echo "== demo" >> "$T"; timeout 40 python3 -m cuflash demo >> "$T" 2>&1; echo "demo exit $?" >> "$T"
B="--mode fwd --budget 0.25"
timeout 110 python3 -m cuflash bench --dtype bf16,fp16 --impl cuflash,sdpa_flash,sdpa_cudnn $B \
  --json "$OUT/fwd_bf16_fp16.json" > "$L" 2>&1
timeout 40 python3 -m cuflash bench --dtype fp32 --d 64,128 --L 1024,4096 --causal false \
  --impl cuflash,naive_cupy $B --json "$OUT/fwd_fp32.json" >> "$L" 2>&1
timeout 45 python3 -m cuflash bench --memory --impl cuflash,naive_cupy,sdpa_flash --dtype bf16 \
  --json "$OUT/memory.json" >> "$L" 2>&1
for tool in memcheck racecheck; do
  echo "== $tool" >> "$S"
  timeout 30 compute-sanitizer --tool $tool --error-exitcode 9 python3 bench/sanitize_smoke.py >> "$S" 2>&1
  echo "exit $?" >> "$S"
done
grep -E "passed|failed|exit" "$T"; grep -A40 "^TFLOP/s" "$L" | head -n 70
grep -iE "peak|memory" "$L" | tail -n 14; grep -E "^==|exit|ERROR SUMMARY" "$S"
