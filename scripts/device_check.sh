#!/usr/bin/env bash
# The device run on a CUDA machine: the extension's build, `pytest -m cuda` and the timings, in one call.
#
#   bash scripts/device_check.sh                              # from the repository root, on a GPU machine
#   TREESPEC_CHECK_DEVICE=cpu bash scripts/device_check.sh    # a smoke test of this script on the CPU op
#
# Budget (DEVICE_CHECK_BUDGET_S, default 480 s = 8 minutes, the most one device call should take): the
# build ~1-3 min (at most 200 s), the bad-input subprocess at most 45 s, `pytest -m cuda tests/test_cuda.py`
# (correctness against float32 / torch references, decoding on the device) under 2 min (at most 150 s),
# then scripts/device_timing.py (under 3 min) at most what is left. Each step runs under `timeout`.
#
# $TREESPEC_CACHE (default /tmp/treespec-device-cache) holds the build (MAX_JOBS default: nproc). With $OUT
# set, everything printed also goes to $OUT/device_check.log, pytest's report to $OUT/pytest-cuda.xml and
# the timings to $OUT/device_timing.json (the benchmarks page reads it); DEVICE_TIMING_ARGS are passed on
# to device_timing.py. If the bad inputs crash the process, ldd of the library and a gdb backtrace follow.
# Exit status: 0 when every check passed, 2 when the extension did not build, else 1.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
BUDGET=${DEVICE_CHECK_BUDGET_S:-480}
DEVICE=${TREESPEC_CHECK_DEVICE:-cuda}
export TREESPEC_TEST_DEVICE=$DEVICE TREESPEC_CACHE=${TREESPEC_CACHE:-/tmp/treespec-device-cache}
export MAX_JOBS=${MAX_JOBS:-$(nproc)} PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1  # a killed step keeps its log
RESULTS=${OUT:-$TREESPEC_CACHE}
LOG=/dev/null
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT" && LOG="$OUT/device_check.log"; fi
TIMING_ARGS=(--out "$RESULTS/device_timing.json")
[ "$DEVICE" = cpu ] && TIMING_ARGS+=(--device cpu --smoke)
BAD_INPUT_DEVICES=(cpu)
[ "$DEVICE" = cpu ] || BAD_INPUT_DEVICES+=("$DEVICE")

seconds_left() { echo $((BUDGET - SECONDS)); }
limit() { local left; left=$(seconds_left); echo $((left < $1 ? (left > 1 ? left : 1) : $1)); }  # min(cap, left)

build() {  # ops.load() under `timeout (limit $1)`; fails unless the ops run on $DEVICE
  timeout "$(limit "$1")" "$PY" -c 'import sys, time; from treespec import ops
start = time.perf_counter(); ok = ops.load(); info = ops.build_info()
print(f"{time.perf_counter() - start:.1f} s:", info)
sys.exit(0 if ok and (info["cuda"] or sys.argv[1] == "cpu") else 1)' "$DEVICE"
}

main() {
  echo "== treespec device check $(date -u +%FT%TZ) on $(hostname), device $DEVICE, budget ${BUDGET} s"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: none"
  command -v nvcc >/dev/null && nvcc --version | tail -1 || echo "nvcc: not on PATH (CUDA_HOME=${CUDA_HOME:-unset})"
  gcc --version 2>/dev/null | head -1 || echo "gcc: none"
  "$PY" -c 'import importlib.util as u, shutil, sys, torch
gpu = torch.cuda.is_available()
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, GPU visible: {gpu}")
ninja = shutil.which("ninja") or ("python module" if u.find_spec("ninja") else "MISSING")
print("ninja:", ninja, "| flash_attn:", "yes" if u.find_spec("flash_attn") else "no")
sys.exit(sys.argv[1] != "cpu" and not gpu)' "$DEVICE" || { echo "no CUDA device visible to torch"; return 2; }

  echo; echo "== build into $TREESPEC_CACHE (MAX_JOBS=$MAX_JOBS)"
  build 200 || {
    echo "FAIL: the extension did not build (with CUDA for device $DEVICE); once more with the compiler's output:"
    TREESPEC_EXT_VERBOSE=1 build 90 2>&1 | tail -60
    return 2; }

  local status=0 rc
  echo; echo "== bad inputs raise RuntimeError (a subprocess, on ${BAD_INPUT_DEVICES[*]})"
  timeout "$(limit 45)" "$PY" -X faulthandler tests/test_cuda.py --bad-inputs "${BAD_INPUT_DEVICES[@]}"; rc=$?
  if [ $rc -gt 128 ] && [ $rc -ne 137 ]; then
    status=1
    echo "FAIL: crashed with signal $((rc - 128)); the library it loaded (with torch's lib/ on the path):"
    LD_LIBRARY_PATH="$("$PY" -c 'import os, torch; print(os.path.dirname(torch.__file__))')/lib" \
      ldd "$("$PY" -c 'from treespec import ops; ops.load(); print(ops.build_info()["path"])')"
    if command -v gdb >/dev/null; then
      timeout "$(limit 90)" gdb -q -batch -ex run -ex "bt 40" \
        --args "$PY" tests/test_cuda.py --bad-inputs "${BAD_INPUT_DEVICES[@]}"
    else echo "(gdb: not installed, no backtrace)"; fi
  elif [ $rc -ne 0 ]; then status=1; echo "FAIL: exit status $rc$([ $rc -eq 124 ] && echo ' (timed out)')"; fi

  echo; echo "== pytest -m cuda tests/test_cuda.py (TREESPEC_TEST_DEVICE=$DEVICE)"  # the one file: no other imports
  local pytest_args=(-q -m cuda -p no:cacheprovider tests/test_cuda.py)
  [ -n "${OUT:-}" ] && pytest_args+=(--junitxml="$OUT/pytest-cuda.xml")
  timeout "$(limit 150)" "$PY" -m pytest "${pytest_args[@]}"; rc=$?
  [ $rc -eq 0 ] || { status=1; echo "FAIL: pytest exit status $rc$([ $rc -eq 124 ] && echo ' (timed out)')"; }

  echo; echo "== timings: scripts/device_timing.py ${TIMING_ARGS[*]} ${DEVICE_TIMING_ARGS:-}"
  if [ ! -f scripts/device_timing.py ]; then echo "(scripts/device_timing.py is not there: skipped)"
  elif [ "$(seconds_left)" -lt 30 ]; then echo "FAIL: skipped, $(seconds_left) s of the budget left"; status=1
  else
    # shellcheck disable=SC2086  # DEVICE_TIMING_ARGS is a list of words
    timeout "$(limit 180)" "$PY" scripts/device_timing.py "${TIMING_ARGS[@]}" ${DEVICE_TIMING_ARGS:-} || {
      echo "FAIL: device_timing.py exit status $?"; status=1; }
  fi
  echo; echo "== device check exit status $status after ${SECONDS} s"
  return $status
}

main 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
