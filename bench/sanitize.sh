#!/usr/bin/env bash
# compute-sanitizer memcheck, racecheck and synccheck over a chosen subset of the GPU tests, in
# one device call (under 10 minutes):
#
#   bash bench/sanitize.sh [TOOL ...]        # default: memcheck racecheck synccheck
#
# Runs the tests listed in bench/sanitize_tests.txt (every kernel family, each dtype, small
# shapes) with `python -m pytest -m gpu -v`, Hypothesis profile `sanitize` (4 derandomized
# examples per property, bench/sanitize_plugin.py), first once without the sanitizer (this
# compiles every kernel specialisation into CuPy's cache, so the sanitizer's time goes to
# running kernels, and shows which tests fail on their own), then under each tool with a time
# budget. Writes under $OUT/sanitize/ (OUT defaults to ./out):
#   <tool>.json            the summary: tool, command, status, errors, tests run, seconds
#                          (bench/sanitize_report.py says what each field means)
#   warmup.json            the run without the sanitizer
#   environment.txt        GPU, driver, commit, sanitizer version
#   logs.tar.gz            <tool>.sanitizer.log (compute-sanitizer's records, --log-file) and
#                          <tool>.console.log (pytest's output, and the sanitizer's if it could
#                          not start), warmup.console.log; SANITIZE_KEEP_LOGS=1 leaves them
#                          as files (6 files in all otherwise: the device tool returns few)
# and prints one line per tool. Exit status 0 when every tool is `clean`.
#
# SANITIZE_PARALLEL=1 runs the three tools at once after the warm-up (which compiles on
# $SANITIZE_WARMUP_WORKERS processes, 12), e.g. for one call:
#   SANITIZE_PARALLEL=1 SANITIZE_BUDGET_WARMUP=100 SANITIZE_BUDGET_MEMCHECK=440 \
#     SANITIZE_BUDGET_RACECHECK=440 SANITIZE_BUDGET_SYNCCHECK=440 bash bench/sanitize.sh
# Budgets (seconds; SANITIZE_BUDGET_<TOOL> overrides), sized for an H200 in one 10-minute call:
#   warmup 90, memcheck 120, racecheck 230, synccheck 90  (530 s, + ~25 s of start-up and
#   reports: under the device tool's 600 s). More racecheck time in a call of its own:
#   SANITIZE_BUDGET_RACECHECK=480 bash bench/sanitize.sh racecheck
# A tool that runs out of budget is stopped with SIGINT (pytest then reports the tests run so
# far) and its summary says `timed_out`. The budgets end the run, never a test's verdict.
# SANITIZE_SHARDS=k splits each tool's tests over k sanitizer processes at once (merged into one
# <tool>.json by sanitize_report.py --merge), e.g. the whole list, the three tools, one call:
#   SANITIZE_PARALLEL=1 SANITIZE_SHARDS=3 SANITIZE_BUDGET_WARMUP=100 \
#     SANITIZE_BUDGET_{MEMCHECK,RACECHECK,SYNCCHECK}=400 bash bench/sanitize.sh
# SANITIZE_TESTS=file replaces bench/sanitize_tests.txt; PYTHON the interpreter (python3).
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-./out}
DIR="$OUT/sanitize"
mkdir -p "$DIR"
PY=${PYTHON:-python3}
LIST=${SANITIZE_TESTS:-bench/sanitize_tests.txt}
TOOLS=("$@")
[ ${#TOOLS[@]} -gt 0 ] || TOOLS=(memcheck racecheck synccheck)
export PYTHONPATH="bench:.${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HYPOTHESIS_PROFILE=sanitize

budget() {
  local var="SANITIZE_BUDGET_${1^^}"
  case $1 in warmup) echo "${!var:-90}" ;; memcheck) echo "${!var:-120}" ;;
    racecheck) echo "${!var:-230}" ;; synccheck) echo "${!var:-90}" ;; *) echo "${!var:-120}" ;;
  esac
}

# the node ids for one tool: every line whose tool list is empty or names it; "?" = optional
tests_for() {
  local tool=$1 line id tools
  while IFS= read -r line; do
    line=${line%%#*}
    read -r id tools <<< "$line"
    [ -n "${id:-}" ] || continue
    if [ "${id:0:1}" = "?" ]; then id=${id:1}; [ -e "${id%%::*}" ] || continue; fi
    if [ -z "${tools:-}" ] || [[ " $tools " == *" $tool "* ]]; then echo "$id"; fi
  done < "$LIST"
}

SANITIZER=$(command -v compute-sanitizer || true)
if [ -z "$SANITIZER" ]; then
  for d in "${CUDA_HOME:-}" /usr/local/cuda /usr/local/cuda-*; do
    if [ -n "$d" ] && [ -x "$d/bin/compute-sanitizer" ]; then SANITIZER="$d/bin/compute-sanitizer"; break; fi
  done
fi
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 || echo "no nvidia-smi"
  git log -1 --format='commit %H %s' 2>/dev/null
  echo "compute-sanitizer: ${SANITIZER:-none}"; [ -n "$SANITIZER" ] && "$SANITIZER" --version 2>&1 | tail -n 1
} > "$DIR/environment.txt"

# -n 0: one process (setup.cfg's addopts spread tests over pytest-xdist workers; the sanitizer
# then watches one application, and its records are in test order)
PYTEST=("$PY" -m pytest -m gpu -n 0 -v -p sanitize_plugin -p no:cacheprovider --tb=short -rfE)
# the warm-up has no sanitizer to watch it: its compilations spread over
# $SANITIZE_WARMUP_WORKERS processes (12; 0: one process, the old way)
WARM=("$PY" -m pytest -m gpu -n "${SANITIZE_WARMUP_WORKERS:-12}" --dist load -p sanitize_plugin
      -p no:cacheprovider -v --tb=short -rfE)

# one run: name, budget, then the command; writes <name>.json
run() {
  local name=$1 limit=$2; shift 2
  local start end rc timed=()
  start=$(date +%s%N)
  timeout -s INT -k 10 "$limit" "$@" > "$DIR/$name.console.log" 2>&1
  rc=$?
  end=$(date +%s%N)
  { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && timed=(--timed-out)
  "$PY" bench/sanitize_report.py --tool "$TOOL_FOR_REPORT" --sanitizer-log "$DIR/$name.sanitizer.log" \
    --console-log "$DIR/$name.console.log" --rc $rc --seconds "$(awk "BEGIN { print ($end - $start) / 1e9 }")" \
    --budget "$limit" --command "$*" "${timed[@]}" --out "$DIR/$name.json" | sed "s/^sanitize $TOOL_FOR_REPORT/$name/"
}

mapfile -t ALL_IDS < <(for t in "${TOOLS[@]}"; do tests_for "$t"; done | awk '!seen[$0]++')
TOOL_FOR_REPORT=none        # the warm-up has no sanitizer: its summary counts the tests only
: > "$DIR/warmup.sanitizer.log"
run warmup "$(budget warmup)" "${WARM[@]}" "${ALL_IDS[@]}"

one_tool() {   # TOOL: its tests under compute-sanitizer; exit status 0 when clean
  TOOL_FOR_REPORT=$TOOL
  local IDS
  mapfile -t IDS < <(tests_for "$TOOL")
  rm -f "$DIR/$TOOL.sanitizer.log"
  if [ -z "$SANITIZER" ]; then
    : > "$DIR/$TOOL.console.log"; : > "$DIR/$TOOL.sanitizer.log"
    "$PY" bench/sanitize_report.py --tool "$TOOL" --sanitizer-log /dev/null --console-log /dev/null \
      --rc 127 --seconds 0 --command "compute-sanitizer (not found)" --missing --out "$DIR/$TOOL.json"
    return 1
  fi
  local shards=${SANITIZE_SHARDS:-1}
  if [ "$shards" -le 1 ] || [ ${#IDS[@]} -le 1 ]; then
    run "$TOOL" "$(budget "$TOOL")" "$SANITIZER" --tool "$TOOL" --error-exitcode 9 \
      --print-limit 200 --log-file "$DIR/$TOOL.sanitizer.log" "${PYTEST[@]}" "${IDS[@]}"
    return
  fi
  # SANITIZE_SHARDS=k: the tool's tests dealt round-robin to k processes, each a sanitizer of
  # its own with the whole budget, at once; their summaries merged into $TOOL.json
  local i j part pids=() parts=()
  for ((i = 0; i < shards; i++)); do
    part=()
    for ((j = i; j < ${#IDS[@]}; j += shards)); do part+=("${IDS[j]}"); done
    [ ${#part[@]} -gt 0 ] || continue
    run "$TOOL.s$i" "$(budget "$TOOL")" "$SANITIZER" --tool "$TOOL" --error-exitcode 9 \
      --print-limit 200 --log-file "$DIR/$TOOL.s$i.sanitizer.log" "${PYTEST[@]}" "${part[@]}" &
    pids+=($!); parts+=("$DIR/$TOOL.s$i.json")
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  "$PY" bench/sanitize_report.py --merge "${parts[@]}" --out "$DIR/$TOOL.json"
  local rc=$?
  # the shards' own summaries travel in the logs archive
  for part in "${parts[@]}"; do mv "$part" "${part%.json}.shard.log"; done
  return $rc
}

# SANITIZE_PARALLEL=1: the tools at once, each a process of its own with its whole budget (the
# GPU time-slices between them; each is mostly waiting on its instrumented kernels and its own
# core), so three budgets of ~450 s fit one 10-minute call
verdict=0
if [ -n "${SANITIZE_PARALLEL:-}" ]; then
  pids=()
  for TOOL in "${TOOLS[@]}"; do one_tool > "$DIR/$TOOL.line" 2>&1 & pids+=($!); done
  for pid in "${pids[@]}"; do wait "$pid" || verdict=1; done
  for TOOL in "${TOOLS[@]}"; do cat "$DIR/$TOOL.line"; rm -f "$DIR/$TOOL.line"; done
else
  for TOOL in "${TOOLS[@]}"; do one_tool || verdict=1; done
fi
# the device tool brings back few files: the logs travel as one archive
if [ -z "${SANITIZE_KEEP_LOGS:-}" ]; then
  (cd "$DIR" && tar -czf logs.tar.gz ./*.log && rm -f ./*.log)
fi
exit $verdict
