#!/usr/bin/env bash
# test_run_gpu_tests.sh — checks run_gpu_tests.sh's exit paths with stand-in gpu_check programs
# (no GPU needed): exit 77 (no device) must skip with status 0 and say so; any other failure must
# fail the script and name gpu_check's real exit status (the script once read $? after `if !`,
# which is always 0). With BUILD_DIR holding a real gpu_check (a CUDA build) on a machine without an
# NVIDIA driver (no nvidia-smi), the real script must skip the same way.
# Usage: tests/gpu/test_run_gpu_tests.sh [REPO_ROOT [BUILD_DIR]]
set -u
ROOT=${1:-$(cd "$(dirname "$0")/../.." && pwd)}
REAL=${2:-}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
fail=0
# run_case NAME GPU_CHECK_EXIT WANT_RC WANT_LINE: a stand-in gpu_check exits GPU_CHECK_EXIT; the
# script's status must be WANT_RC and its output must hold WANT_LINE. compute-sanitizer is kept off
# the PATH so that only the gpu_check step runs (the sanitizer would run the stand-in too).
run_case() {
  local name=$1 code=$2 want_rc=$3 want=$4
  mkdir -p "$T/$name/bin"
  printf '#!/bin/sh\necho "stand-in gpu_check: exit %s"\nexit %s\n' "$code" "$code" >"$T/$name/bin/gpu_check"
  chmod +x "$T/$name/bin/gpu_check"
  local out rc
  out=$(cd "$ROOT" && env PATH=/usr/bin:/bin KVPQ_NO_BENCH=1 bash tests/gpu/run_gpu_tests.sh "$T/$name/bin" "$T/$name/out" 2>&1)
  rc=$?
  if [ "$rc" != "$want_rc" ] || ! grep -qF -- "$want" <<<"$out"; then
    echo "FAIL $name: exit $rc (want $want_rc), output:"; echo "$out"; fail=1
  else
    echo "ok   $name: exit $rc, \"$want\""
  fi
}
run_case skip 77 0 "GPU tests skipped: gpu_check found no usable CUDA device (exit 77"
run_case fail3 3 1 "gpu_check FAILED (exit 3 after"
run_case fail1 1 1 "gpu_check FAILED (exit 1 after"
run_case pass 0 0 "gpu_check passed in"
# the sanitizer step with a stand-in compute-sanitizer that reports errors (exit 99), run one after
# another and in parallel: the script must fail naming the status
mkdir -p "$T/san/bin" "$T/san/tools"
printf '#!/bin/sh\nexit 0\n' >"$T/san/bin/gpu_check"
printf '#!/bin/sh\necho "stand-in sanitizer $*"\nexit 99\n' >"$T/san/tools/compute-sanitizer"
chmod +x "$T/san/bin/gpu_check" "$T/san/tools/compute-sanitizer"
for par in 0 1; do
  out=$(cd "$ROOT" && env PATH="$T/san/tools:/usr/bin:/bin" KVPQ_NO_BENCH=1 KVPQ_GPU_PARALLEL=$par \
        bash tests/gpu/run_gpu_tests.sh "$T/san/bin" "$T/san/out$par" 2>&1)
  rc=$?
  n=$(grep -c "compute-sanitizer .*: FAILED (exit 99 after" <<<"$out")
  if [ "$rc" != 1 ] || [ "$n" != 2 ]; then
    echo "FAIL sanitizer errors (parallel=$par): exit $rc, $n FAILED lines (want 1, 2), output:"; echo "$out"; fail=1
  else
    echo "ok   sanitizer errors (parallel=$par): exit 1, both named with exit 99"
  fi
done
if [ -n "$REAL" ] && [ -x "$REAL/gpu_check" ] && ! command -v nvidia-smi >/dev/null; then
  out=$(cd "$ROOT" && env PATH=/usr/bin:/bin KVPQ_NO_BENCH=1 bash tests/gpu/run_gpu_tests.sh "$REAL" "$T/real" 2>&1)
  rc=$?
  if [ "$rc" != 0 ] || ! grep -qF "GPU tests skipped" <<<"$out" || ! grep -q "^SKIP: " <<<"$out"; then
    echo "FAIL real gpu_check without a device: exit $rc, output:"; echo "$out"; fail=1
  else
    echo "ok   real gpu_check without a device: exit 0, $(grep '^SKIP: ' <<<"$out")"
  fi
fi
exit $fail
