#!/usr/bin/env bash
# run_gpu_tests.sh — the GPU checks in one go, on a machine with a CUDA device:
#   1. gpu_check (encode/decode/attention against float64 references, fresh random inputs)
#   2. the same under compute-sanitizer memcheck (and racecheck), with KVPQ_QUICK=1 sizes
#   3. bench/gpu_bench.py (ours vs seed kernel, materializing path, PyTorch matmul+argmin, SDPA)
# Usage: tests/gpu/run_gpu_tests.sh [BUILD_DIR [OUT_DIR]]   (build with -DKVPQ_CUDA=ON first)
# Without a device gpu_check exits 77: the script says so and exits 0 (nothing else runs). Any
# other failure makes the script exit 1 after the remaining steps, each failure named with the
# exit status of the command that failed. KVPQ_NO_BENCH=1 leaves out step 3. KVPQ_GPU_PARALLEL=1
# runs gpu_check and the two sanitizer runs at the same time (less device time; each is bound by
# its own host work and instrumentation; the bench always runs alone, after them).
# tests/gpu/test_run_gpu_tests.sh checks the exit paths with stand-in gpu_check programs.
set -u
BUILD=${1:-build}
OUT=${2:-${OUT:-out/gpu}}
mkdir -p "$OUT"
rc=0
par=${KVPQ_GPU_PARALLEL:-0}
have_san=0
command -v compute-sanitizer >/dev/null && have_san=1
pids=()
# one sanitizer run in the background; its status and seconds go to sanitizer_TOOL.status
sanitize() {
  local tool=$1 sub=""
  # racecheck is slow: the default encode variant on a few shapes (KVPQ_ENCODE_SHAPES=few) and the
  # tensor-core kernel as chosen per launch and with 16-warp CTAs (at KVPQ_QUICK sizes the default picks
  # 8) only (memcheck: every variant, every shape). KVPQ_RACECHECK_ATTEND=357 adds the default LUT
  # kernel (variant 3: over 500 s on an H200, session 10; clean in session 7)
  [ "$tool" = racecheck ] && sub="KVPQ_ENCODE_VARIANTS=5 KVPQ_ENCODE_SHAPES=few KVPQ_ATTEND_VARIANTS=${KVPQ_RACECHECK_ATTEND:-57}"
  ( t0=$SECONDS
    env KVPQ_QUICK=1 $sub compute-sanitizer --tool "$tool" --error-exitcode 99 "$BUILD/gpu_check" \
      >"$OUT/sanitizer_$tool.log" 2>&1
    echo "$? $((SECONDS - t0))" >"$OUT/sanitizer_$tool.status" ) &
  pids+=($!)
}
if [ "$par" = 1 ] && [ "$have_san" = 1 ]; then sanitize memcheck; sanitize racecheck; fi
t0=$SECONDS
# the status must be read right after the command: inside `if ! cmd; then` $? is that of the `!`
"$BUILD/gpu_check" >"$OUT/gpu_check.log" 2>&1
st=$?
cat "$OUT/gpu_check.log"
if [ "$st" = 77 ]; then
  [ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"
  echo "GPU tests skipped: gpu_check found no usable CUDA device (exit 77; see the line above)"
  exit 0
elif [ "$st" != 0 ]; then
  echo "gpu_check FAILED (exit $st after $((SECONDS - t0)) s)"
  rc=1
else
  echo "gpu_check passed in $((SECONDS - t0)) s"
fi
if [ "$have_san" = 1 ]; then
  if [ "$par" != 1 ]; then
    sanitize memcheck; wait "${pids[@]}"
    sanitize racecheck; wait "${pids[@]}"
  else
    wait "${pids[@]}"
  fi
  for tool in memcheck racecheck; do
    read -r st secs <"$OUT/sanitizer_$tool.status"
    if [ "$st" = 0 ]; then
      echo "compute-sanitizer $tool: clean in ${secs} s ($(tail -1 "$OUT/sanitizer_$tool.log"))"
    else
      echo "compute-sanitizer $tool: FAILED (exit $st after ${secs} s; 99: sanitizer errors, else gpu_check's own status)"
      tail -30 "$OUT/sanitizer_$tool.log"; rc=1
    fi
  done
else
  echo "compute-sanitizer not found: sanitizer step skipped"
fi
if [ "${KVPQ_NO_BENCH:-0}" != 1 ]; then
  PYTHONUNBUFFERED=1 python3 bench/gpu_bench.py --bin "$BUILD/gpu_bench_kernels" --out "$OUT" ${KVPQ_BENCH_QUICK:+--quick}
  st=$?
  if [ "$st" != 0 ]; then echo "gpu_bench.py FAILED (exit $st)"; rc=1; fi
fi
exit $rc
