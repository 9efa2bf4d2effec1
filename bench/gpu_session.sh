#!/usr/bin/env bash
# One call on the lent GPU: environment, GPU tests, benchmark; everything lands in $OUT.
#   bash bench/gpu_session.sh "<pytest args>" "<bench args>"
# Run from the repository root with PYTHONPATH=. (the device machine cannot pip install).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -m cuflash info; } 2>&1 | tee "$OUT/env.txt"
if [ -n "${1:-}" ]; then
  # shellcheck disable=SC2086
  python3 -m pytest -m gpu -p no:cacheprovider -q --maxfail=15 --tb=short $1 2>&1 | tee "$OUT/pytest.txt" | tail -n 60
  echo "pytest exit: ${PIPESTATUS[0]}"
fi
if [ -n "${2:-}" ]; then
  # shellcheck disable=SC2086
  python3 -m cuflash bench $2 --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt" | tail -n 80
fi
