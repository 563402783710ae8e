#!/bin/bash
# device call 3 (device helper, session 11): the final tree of branch `device` (encode default
# variant 5; attention kernels as at main), built on the development machine (nvcc 13.0, sm_90):
# first a diagnostic timeline of main's tensor-core attention kernel (globaltimer and clock64 stamps
# per CTA, a KVPQ_ATTEND_DEV_SHAPES build of 3_attend_timeline_diag.diff, not shipped), then
# gpu_check, compute-sanitizer memcheck and racecheck at the same time (run_gpu_tests.sh,
# KVPQ_GPU_PARALLEL=1; racecheck: encode variant 5 on the few shapes, attention variants 5 and 7).
set -u
cd "$(dirname "$0")/../../.."
export LD_LIBRARY_PATH=$PWD/../libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=../build-cuda
date -u | tee $OUT/env.txt; nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader | tee -a $OUT/env.txt
for f in $B/gpu_check $B/gpu_bench_kernels $B/libkvpq.so ../devbin/tl/gpu_bench_kernels; do ldd $f | grep "not found"; done
for s in "1 4096" "1 32768" "8 32768"; do timeout 60 ../devbin/tl/gpu_bench_kernels attend $s 2>&1 | grep -E '"timeline"|"op": "attend"|rror' | tee -a $OUT/timeline.txt; done
t0=$SECONDS
KVPQ_GPU_PARALLEL=1 KVPQ_NO_BENCH=1 timeout 500 tests/gpu/run_gpu_tests.sh $B $OUT/checks > $OUT/checks.out 2>&1; echo "run_gpu_tests exit $? in $((SECONDS-t0)) s"
date -u
grep -E "FAIL|passed|clean|skipped|seed" $OUT/checks.out | head -20
tail -n 3 $OUT/checks/sanitizer_memcheck.log $OUT/checks/sanitizer_racecheck.log
cat $OUT/checks/*.status
cd $OUT/checks && tar czf $OUT/checks.tgz . 2>/dev/null; true
