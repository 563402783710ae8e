#!/bin/bash
# Device call 4 of issue 36 (item 1 and item 4's lazy pages): the binaries of tests_device.sh rebuilt
# with the default page pool of kvpq_cuda_cache growing on demand. gpu_cache_backend_check (with its
# pool check) at full sizes, then under memcheck (KVPQ_QUICK) beside gpu_check (full) and gpu_check
# under memcheck (KVPQ_QUICK). Run as: bash .dev-gpu/pool_device.sh $OUT
set -u
source "$(dirname "$0")/common.sh" "$1"
step cache_backend_check timeout 240 bins/gpu_cache_backend_check
( export KVPQ_QUICK=1; step memcheck_cache_backend timeout 300 compute-sanitizer --tool memcheck --error-exitcode 99 \
    bins/gpu_cache_backend_check; step memcheck_gpu_check timeout 400 compute-sanitizer --tool memcheck \
    --error-exitcode 99 bins/gpu_check ) &
step gpu_check timeout 420 bins/gpu_check
wait
date -u | tee -a $O/env.txt
grep -v "^  " $O/cache_backend_check.log | tail -n 8
tail -n 3 $O/memcheck_cache_backend.log $O/memcheck_gpu_check.log $O/gpu_check.log
cat $O/summary.txt
