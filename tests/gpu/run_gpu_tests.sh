#!/usr/bin/env bash
# run_gpu_tests.sh — the GPU checks in one go, on a machine with a CUDA device:
#   1. gpu_check (encode/decode/attention against float64 references, fresh random inputs)
#   2. the same under compute-sanitizer memcheck (and racecheck), with KVPQ_QUICK=1 sizes
#   3. bench/gpu_bench.py (ours vs seed kernel, materializing path, PyTorch matmul+argmin, SDPA)
# Usage: tests/gpu/run_gpu_tests.sh [BUILD_DIR [OUT_DIR]]   (build with -DKVPQ_CUDA=ON first)
# Without a device every step reports SKIP and the script exits 0.
set -u
BUILD=${1:-build}
OUT=${2:-${OUT:-out/gpu}}
mkdir -p "$OUT"
rc=0
if ! "$BUILD/gpu_check" >"$OUT/gpu_check.log" 2>&1; then
  st=$?
  cat "$OUT/gpu_check.log"
  if [ "$st" = 77 ]; then echo "GPU tests skipped"; exit 0; fi
  echo "gpu_check FAILED ($st)"; rc=1
else
  cat "$OUT/gpu_check.log"
fi
if command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    # racecheck is slow: the default encode variant on a few shapes (KVPQ_ENCODE_SHAPES=few), the default LUT
    # kernel and the tensor-core kernel with 16-warp CTAs (at KVPQ_QUICK sizes the default picks 8)
    # only (memcheck: every variant, every shape)
    sub=""
    [ "$tool" = racecheck ] && sub="KVPQ_ENCODE_VARIANTS=3 KVPQ_ENCODE_SHAPES=few KVPQ_ATTEND_VARIANTS=357"
    if env KVPQ_QUICK=1 $sub compute-sanitizer --tool "$tool" --error-exitcode 99 "$BUILD/gpu_check" >"$OUT/sanitizer_$tool.log" 2>&1; then
      echo "compute-sanitizer $tool: clean ($(tail -1 "$OUT/sanitizer_$tool.log"))"
    else
      echo "compute-sanitizer $tool: FAILED"; tail -30 "$OUT/sanitizer_$tool.log"; rc=1
    fi
  done
else
  echo "compute-sanitizer not found: sanitizer step skipped"
fi
if [ "${KVPQ_NO_BENCH:-0}" != 1 ]; then
  PYTHONUNBUFFERED=1 python3 bench/gpu_bench.py --bin "$BUILD/gpu_bench_kernels" --out "$OUT" ${KVPQ_BENCH_QUICK:+--quick} || rc=1
fi
exit $rc
