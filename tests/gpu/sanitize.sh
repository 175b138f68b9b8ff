#!/usr/bin/env bash
# Run tests/gpu/sanitize_cases.py under compute-sanitizer's tools, normal and portable passes.
#
#   bash tests/gpu/sanitize.sh                    # warm-up, then memcheck racecheck synccheck initcheck
#   bash tests/gpu/sanitize.sh memcheck           # one tool (or several: memcheck initcheck)
#   bash tests/gpu/sanitize.sh --no-warmup racecheck
#   bash tests/gpu/sanitize.sh --quick            # every tool on the quick subset
#
# Options: --quick (quick subset for every tool), --no-warmup (skip the unsanitized compile run),
# --full-racecheck (racecheck on the full subset; it is slow, so the quick one is the default).
# Environment: PYTHON (default python), PASSES ("normal portable" by default; e.g. PASSES=normal),
# SANITIZE_LOG_DIR (per-run logs; default $OUT/sanitize when $OUT is set, else a temp folder),
# SANITIZE_TIMEOUT (seconds per sanitizer run, 0 = none: a run past it counts as a failure),
# SANITIZE_EXTRA (extra compute-sanitizer arguments, e.g. "--report-api-errors no"),
# COMPUTE_SANITIZER (path to compute-sanitizer).
#
# The case script runs with CuPy's memory pools off (FLASHCUPY_NO_POOL=1), so every array is
# its own cudaMalloc: memcheck sees real allocation bounds and initcheck real first writes, and
# the leak check sees what is freed. CUPY_ACCELERATORS is empty (no CUB/cuTENSOR kernels).
# Exit status: 0 when every run reported no error, 1 otherwise, 2 on bad usage.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python}"
CASES="tests/gpu/sanitize_cases.py"

usage() { sed -n '2,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

TOOLS=()
QUICK=0
WARMUP=1
FULL_RACECHECK=0
for arg in "$@"; do
  case "$arg" in
    memcheck|racecheck|synccheck|initcheck) TOOLS+=("$arg") ;;
    all) TOOLS+=(memcheck racecheck synccheck initcheck) ;;
    --quick) QUICK=1 ;;
    --no-warmup) WARMUP=0 ;;
    --full-racecheck) FULL_RACECHECK=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "sanitize.sh: unknown argument '$arg'" >&2; usage >&2; exit 2 ;;
  esac
done
if [ "${#TOOLS[@]}" -eq 0 ]; then
  TOOLS=(memcheck racecheck synccheck initcheck)
fi
read -r -a PASS_LIST <<< "${PASSES:-normal portable}"
for p in "${PASS_LIST[@]}"; do
  case "$p" in normal|portable) ;; *) echo "sanitize.sh: PASSES: unknown pass '$p'" >&2; exit 2 ;; esac
done

SANITIZER="${COMPUTE_SANITIZER:-}"
if [ -z "$SANITIZER" ]; then
  for candidate in "$(command -v compute-sanitizer || true)" "${CUDA_PATH:-/usr/local/cuda}/bin/compute-sanitizer" \
                   /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
    if [ -n "$candidate" ] && [ -x "$candidate" ]; then SANITIZER="$candidate"; break; fi
  done
fi
if [ -z "$SANITIZER" ]; then
  echo "sanitize.sh: compute-sanitizer not found (set COMPUTE_SANITIZER)" >&2
  exit 2
fi

if [ -n "${SANITIZE_LOG_DIR:-}" ]; then
  LOG_DIR="$SANITIZE_LOG_DIR"
elif [ -n "${OUT:-}" ]; then
  LOG_DIR="$OUT/sanitize"
else
  LOG_DIR="$(mktemp -d -t flashcupy-sanitize.XXXXXX)"
fi
mkdir -p "$LOG_DIR"
TIMEOUT="${SANITIZE_TIMEOUT:-0}"
read -r -a EXTRA <<< "${SANITIZE_EXTRA:-}"

export FLASHCUPY_NO_POOL=1
export CUPY_ACCELERATORS=

echo "sanitize.sh: $("$SANITIZER" --version | tail -n 1)"
echo "sanitize.sh: tools: ${TOOLS[*]}; passes: ${PASS_LIST[*]}; logs in $LOG_DIR"

pass_args() {  # pass quick -> case-script arguments
  local args=()
  [ "$1" = portable ] && args+=(--portable)
  [ "$2" = 1 ] && args+=(--quick)
  echo "${args[@]}"
}

if [ "$WARMUP" = 1 ]; then
  for p in "${PASS_LIST[@]}"; do
    # Full subset, 8 threads: every specialisation any tool will need compiles (in parallel)
    # into CuPy's disk cache, and the cases are known to run before a sanitizer slows them.
    t0=$SECONDS
    # shellcheck disable=SC2046
    if ! "$PYTHON" "$CASES" $(pass_args "$p" 0) --jobs 8 > "$LOG_DIR/warmup-$p.log" 2>&1; then
      cat "$LOG_DIR/warmup-$p.log"
      echo "sanitize.sh: the warm-up run ($p) failed without a sanitizer; fix that first" >&2
      exit 1
    fi
    echo "sanitize.sh: warm-up $p: $(tail -n 1 "$LOG_DIR/warmup-$p.log") [$((SECONDS - t0)) s]"
  done
fi

SUMMARY=()
FAILED=0
for tool in "${TOOLS[@]}"; do
  tool_args=(--tool "$tool" --error-exitcode 1 --print-limit 20)
  quick=$QUICK
  case "$tool" in
    # Leak checking reports device allocations still alive when the interpreter exits (the
    # harness's, at teardown), not accesses; opt in with LEAK_CHECK=1.
    memcheck) [[ "${LEAK_CHECK:-0}" == 1 ]] && tool_args+=(--leak-check full) ;;
    racecheck) [ "$FULL_RACECHECK" = 1 ] || quick=1 ;;
  esac
  for p in "${PASS_LIST[@]}"; do
    log="$LOG_DIR/$tool-$p.log"
    # shellcheck disable=SC2207
    case_args=($(pass_args "$p" "$quick"))
    cmd=("$SANITIZER" "${tool_args[@]}" "${EXTRA[@]}" "$PYTHON" "$CASES" "${case_args[@]}")
    if [ "$TIMEOUT" != 0 ]; then cmd=(timeout --signal=INT --kill-after=20 "$TIMEOUT" "${cmd[@]}"); fi
    echo
    echo "==== $tool / $p$([ "$quick" = 1 ] && echo ' (quick)'): ${cmd[*]}"
    t0=$SECONDS
    rc=0
    "${cmd[@]}" 2>&1 | tee "$log" || rc=${PIPESTATUS[0]}
    seconds=$((SECONDS - t0))
    line="$(grep -E '(ERROR|RACECHECK|LEAK) SUMMARY' "$log" | sed 's/^=* *//' | paste -sd ';' - || true)"
    [ -n "$line" ] || line="(no summary line: the run did not finish)"
    if [ "$rc" = 0 ]; then status=PASS; else status="FAIL rc=$rc"; FAILED=1; fi
    [ "$rc" = 124 ] && status="FAIL (timed out after ${TIMEOUT} s)"
    SUMMARY+=("$(printf '%-9s %-8s %-22s %4ss  %s' "$tool" "$p" "$status" "$seconds" "$line")")
  done
done

echo
echo "==== compute-sanitizer summary (logs in $LOG_DIR)"
for line in "${SUMMARY[@]}"; do echo "$line"; done
if [ "$FAILED" != 0 ]; then
  echo
  echo "==== first reports of failing runs"
  for tool in "${TOOLS[@]}"; do
    for p in "${PASS_LIST[@]}"; do
      log="$LOG_DIR/$tool-$p.log"
      [ -f "$log" ] || continue
      if grep -qE '^========= (Invalid|Uninitialized|Race|Error|Barrier|Leaked|Program hit|Warning|Malloc|Unused|Cuda)|^FAIL ' "$log"; then
        echo "-- $tool / $p"
        grep -E '^========= (Invalid|Uninitialized|Race|Error|Barrier|Leaked|Program hit|Warning|Malloc|Unused|Cuda)|^FAIL ' "$log" | head -n 15
      fi
    done
  done
  echo "sanitize.sh: FAILED"
  exit 1
fi
echo "sanitize.sh: all runs clean"
