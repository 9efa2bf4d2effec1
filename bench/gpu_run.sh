#!/usr/bin/env bash
# The GPU runs of the project, in parts; run from the repository root on a machine with a GPU.
#
#   bash bench/gpu_run.sh PART [PART ...]          results and logs land in $OUT (default ./out)
#
# Parts (each prints its summary lines and appends them to $OUT/summary.txt):
#   tests     the GPU test suite (pytest -m gpu, HYPOTHESIS_PROFILE=${TESTS_PROFILE:-gpu}, spread over
#             $TESTS_WORKERS processes, default 15, with pytest-xdist; --maxprocesses too, or
#             setup.cfg's cap of 8 wins: session 17's call 2 ran 8 and hit its time limit) -> tests.log
#             (TESTS_VERBOSITY=-v names every test that passed, so a run cut by TESTS_TIMEOUT can
#             be completed by a second one: TESTS_IDS_FILE=left.txt, the ids it did not reach;
#             bench/tests_left.py writes that file from the first run's log)
#             ~7 min (1099 tests in 397 s on 15 processes, session 15); --dist load, not
#             setup.cfg's loadfile, which sends a whole file (test_gpu_modifiers.py: 100+ tests
#             of compile-heavy variants) to one worker
#   gate      the whole compile gate, every specialisation of every arch (python -m cuflash
#             check; CI compiles only its covering set, cuflash/_gate.py) -> gate.log
#             ~1 min on 16 cores
#   bench     suites fwd (d 64/128/256) and fwd_bwd (d 64/128), bf16, L 1k/4k/16k, causal and
#             not, cuflash against sdpa_flash and sdpa_cudnn, back-to-back calls; each suite
#             capped at 110 s of timing                   -> fwd.json fwd.png fwd_bwd.json fwd_bwd.png bench.log
#             ~4 min
#   isolated  suite fwd --isolated: one call with the GPU idle before it, bf16, d 64/128/256,
#             L 512/1k, causal and not, same peers        -> fwd_isolated.json fwd_isolated.png isolated.log
#             ~1 min
#   overhead  bench/host_overhead.py --rounds 4: µs of host time per call, the implementations
#             interleaved                            -> host_overhead.json overhead.log
#             ~1 min
#   sanitize  bench/sanitize.sh: compute-sanitizer memcheck, racecheck and synccheck over the
#             GPU tests of bench/sanitize_tests.txt   -> sanitize/{memcheck,racecheck,synccheck,
#             warmup}.json, environment.txt, logs.tar.gz
#             ~9.5 min: alone in one device call
#   correctness  tests, a 10,000-example fuzz campaign (5 processes) and the sanitizer at once,
#             in ~8 min (part_correctness says how)  -> tests.log fuzz.json fuzz.log sanitize/
#   fuzz      the fuzz campaign alone (part_fuzz: FUZZ_SHARDS, FUZZ_EXAMPLES, FUZZ_SECONDS,
#             FUZZ_SEED0)                            -> fuzz.json fuzz.log fuzz_shards.tar.gz
#   pending   the A/B probes of the switches still off for want of a GPU run (session 11's)
#             -> decode_ab_s11.json window_lean.json bmask_s11.json bmask_short_wg.json pending.log
#
# Suggested device calls (each under 10 minutes; the device tool returns at most 8 files):
#   bash bench/gpu_run.sh gate tests
#   bash bench/gpu_run.sh bench
#   bash bench/gpu_run.sh isolated overhead
#   bash bench/gpu_run.sh sanitize
# Then copy the JSON and PNG files into bench/results/h200/ and commit them (bench/README.md).
# The machine needs python3 with CuPy (and PyTorch, JAX for the peers); nothing is installed.
set -u
OUT=${OUT:-./out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
SUMMARY="$OUT/summary.txt"

note() { echo "$*" | tee -a "$SUMMARY"; }

env_lines() {
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv 2>&1
  git log -1 --format='commit %H %s' 2>/dev/null
  git status --porcelain --untracked-files=no 2>/dev/null | sed 's/^/dirty: /'
}

# The test and fuzz processes run side by side (15 of them on 16 cores), each checking against
# float64 NumPy: one BLAS thread each. Left alone, OpenBLAS starts a thread per core in every
# process (~240 threads on 16 cores). Session 14's test_gpu_window_persist took 29-44 s a test
# on the H200 machine; its oracle check takes 2.6-4.2 s on one core of the CPU machine.
ONE_BLAS=(env OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1)

part_tests() {
  local log="$OUT/tests.log"
  { env_lines; "$PY" -m cuflash info; } > "$log" 2>&1
  local ids=()
  [ -n "${TESTS_IDS_FILE:-}" ] && mapfile -t ids < "$TESTS_IDS_FILE"
  # SIGINT, not SIGTERM: pytest then still prints its summary and the names of the failures.
  # In a process group of its own (setsid), killed whole afterwards: pytest-xdist workers left
  # running after the time limit loaded the machine under session 7's next (timed) call.
  HYPOTHESIS_PROFILE=${TESTS_PROFILE:-gpu} setsid timeout -s INT "${TESTS_TIMEOUT:-560}" \
    "${ONE_BLAS[@]}" "$PY" -m pytest -m gpu -n "${TESTS_WORKERS:-15}" \
    --maxprocesses "${TESTS_WORKERS:-15}" --dist load -p no:cacheprovider \
    "${TESTS_VERBOSITY:--q}" --tb=short -rfE --durations=40 "${ids[@]}" \
    >> "$log" 2>&1 &
  local pg=$!
  wait "$pg"
  local rc=$?
  kill -TERM -- "-$pg" 2>/dev/null; sleep 2; kill -KILL -- "-$pg" 2>/dev/null
  note "tests: exit $rc: $(grep -E '[0-9]+ (passed|failed|error)' "$log" | tail -n 1)"
}

part_gate() {
  local log="$OUT/gate.log"
  env_lines > "$log"
  timeout 300 "$PY" -m cuflash check >> "$log" 2>&1
  note "gate (all specialisations): exit $? ($(grep -E '^[0-9]+ compilations' "$log" | tail -n 1))"
}

part_bench() {
  local log="$OUT/bench.log"
  env_lines > "$log"
  local common=(--dtype bf16 --L 1024,4096,16384 --causal false,true
                --impl cuflash,sdpa_flash,sdpa_cudnn --budget 0.2 --max-seconds 110 --plot)
  timeout 150 "$PY" bench/bench_attention.py --suite fwd --d 64,128,256 "${common[@]}" \
    --json "$OUT/fwd.json" >> "$log" 2>&1
  note "bench fwd: exit $?"
  timeout 150 "$PY" bench/bench_attention.py --suite fwd_bwd --d 64,128 "${common[@]}" \
    --json "$OUT/fwd_bwd.json" >> "$log" 2>&1
  note "bench fwd_bwd: exit $?"
  grep -A 40 "^TFLOP/s" "$log"
}

part_isolated() {
  local log="$OUT/isolated.log"
  env_lines > "$log"
  timeout 240 "$PY" bench/bench_attention.py --suite fwd --isolated --dtype bf16 \
    --d 64,128,256 --L 512,1024 --causal false,true --impl cuflash,sdpa_flash,sdpa_cudnn \
    --plot --json "$OUT/fwd_isolated.json" >> "$log" 2>&1
  note "isolated: exit $?"
  grep -A 20 "^TFLOP/s" "$log"
}

part_overhead() {
  local log="$OUT/overhead.log"
  env_lines > "$log"
  # (--rounds: the implementations interleaved, so a change of the host's speed within the run
  # reaches all of them; session 19 read one machine's SDPA at 17.7 and 28.3 us a minute apart)
  timeout 150 "$PY" bench/host_overhead.py --out "$OUT" --rounds 4 --repeats 3 --profile >> "$log" 2>&1
  note "overhead: exit $?"
  grep -B 1 -A 8 "^ *impl" "$log"
}

part_correctness() {
  # The GPU tests, a fuzz campaign and the sanitizer at once (none of them is timed, so they
  # may share the GPU; NVRTC compiles of the specialisations they need spread over the cores):
  #   tests     -n $CORR_TEST_WORKERS (8), $TESTS_PROFILE (gpu), stopped at $CORR_SECONDS - 60
  #   fuzz      $FUZZ_SHARDS (5) processes of python -m cuflash fuzz, seeds $FUZZ_SEED0 (1).., together
  #             $FUZZ_EXAMPLES (10000) examples of every feature, each stopped after
  #             $CORR_SECONDS - 90 s; merged by bench/fuzz_merge.py  -> fuzz.json fuzz.log
  #   sanitize  bench/sanitize.sh with budgets summing to about $CORR_SECONDS - 80
  # ~$CORR_SECONDS (480) s in all. Logs: tests.log, fuzz.log, sanitize/
  local secs=${CORR_SECONDS:-480} shards=${FUZZ_SHARDS:-5} n=${FUZZ_EXAMPLES:-10000}
  TESTS_WORKERS=${CORR_TEST_WORKERS:-8} TESTS_TIMEOUT=$((secs - 60)) part_tests &
  local tests_pid=$!
  local b=$((secs - 80))
  SANITIZE_BUDGET_WARMUP=$((b * 15 / 100)) SANITIZE_BUDGET_MEMCHECK=$((b * 25 / 100)) \
    SANITIZE_BUDGET_RACECHECK=$((b * 40 / 100)) SANITIZE_BUDGET_SYNCCHECK=$((b * 20 / 100)) \
    part_sanitize > "$OUT/sanitize.out" 2>&1 &
  local san_pid=$!
  fuzz_campaign $((secs - 90)) "$shards" "$n" "${FUZZ_SEED0:-1}"
  wait "$tests_pid" "$san_pid"
  cat "$OUT/sanitize.out"
}

# fuzz_campaign SECONDS SHARDS EXAMPLES FIRST_SEED: SHARDS processes of python -m cuflash fuzz
# (seeds FIRST_SEED.., every feature), together EXAMPLES examples, each stopped after SECONDS;
# merged by bench/fuzz_merge.py -> fuzz.json fuzz.log
fuzz_campaign() {
  local secs=$1 shards=$2 n=$3 seed0=$4 pids=() i dir="$OUT/fuzz_shards"
  mkdir -p "$dir"
  for i in $(seq "$seed0" $((seed0 + shards - 1))); do
    "${ONE_BLAS[@]}" "$PY" -m cuflash fuzz --examples $(( (n + shards - 1) / shards )) --device gpu --seed "$i" \
      --quiet --time-limit "$secs" --report "$dir/fuzz_shard$i.json" \
      > "$dir/fuzz_shard$i.log" 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"
  cat "$dir"/fuzz_shard*.log > "$OUT/fuzz.log"
  "$PY" bench/fuzz_merge.py "$OUT/fuzz.json" "$dir"/fuzz_shard*.json >> "$OUT/fuzz.log" 2>&1
  note "fuzz: exit $? ($(tail -n 1 "$OUT/fuzz.log"))"
  # the device tool brings back few files: the shards' reports travel as one archive
  tar -czf "$OUT/fuzz_shards.tar.gz" -C "$OUT" fuzz_shards && rm -rf "$dir"
}

part_fuzz() {
  # the campaign alone on the machine: $FUZZ_SHARDS (15) processes, $FUZZ_EXAMPLES (10008)
  # examples, each process stopped after $FUZZ_SECONDS (500) s, seeds from $FUZZ_SEED0 (1)
  fuzz_campaign "${FUZZ_SECONDS:-500}" "${FUZZ_SHARDS:-15}" "${FUZZ_EXAMPLES:-10008}" "${FUZZ_SEED0:-1}"
}

part_pending() {
  # the A/B probes of the switches that are off until they have run on a GPU (bench/NOTES.md,
  # "Session 11: what landed without a GPU"): each arm named in its probe, old = the default;
  # ~5 min on a fresh H200, most of it compiling. Then `python bench/pending_decide.py $OUT`
  # says which to turn on (export lines for the suites' call), and the defaults are flipped.
  local log="$OUT/pending.log" p
  env_lines > "$log"
  for p in "decode_ab.py --json $OUT/decode_ab_s11.json" \
           "window_lean.py --modes fwd --json $OUT/window_lean.json" \
           "bmask_bwd128.py --json $OUT/bmask_s11.json" \
           "bmask_short_wg.py --L 4096 --json $OUT/bmask_short_wg.json"; do
    echo "== $p ($(date +%T))" >> "$log"
    # shellcheck disable=SC2086
    timeout 120 "$PY" bench/probes/$p >> "$log" 2>&1
    note "pending ${p%% *}: exit $?"
  done
}

part_sanitize() {
  # bench/sanitize.sh: memcheck, racecheck, synccheck over bench/sanitize_tests.txt, one JSON
  # summary per tool under $OUT/sanitize/ (its header says the budgets: ~9.5 min in all)
  OUT="$OUT" bash bench/sanitize.sh
  note "sanitize: exit $?"
}

[ $# -gt 0 ] || { sed -n '2,30p' "$0"; exit 2; }
for part in "$@"; do
  case $part in
    tests|gate|bench|isolated|overhead|sanitize|correctness|fuzz|pending) "part_$part" ;;
    *) echo "unknown part '$part' (tests, gate, bench, isolated, overhead, sanitize, correctness, fuzz, pending)" >&2
       exit 2 ;;
  esac
done
