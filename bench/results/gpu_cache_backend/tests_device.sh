#!/bin/bash
# Device call 1 of issue 36 item 1 (one cache API): bins/ holds gpu_cache_backend_check and
# gpu_check built on the development machine (nvcc 13.0, -DKVPQ_CUDA=ON -DCMAKE_BUILD_TYPE=Release
# -DKVPQ_WERROR=ON -DCMAKE_CUDA_ARCHITECTURES=90-real), libs/ libcjson. Run from the repository
# root as: bash .dev-gpu/tests_device.sh $OUT
set -u
source "$(dirname "$0")/common.sh" "$1"
# the unified API on the GPU against the CPU cache (full sizes); then memcheck of it (KVPQ_QUICK
# sizes) beside the existing gpu_check suite (full)
step cache_backend_check timeout 240 bins/gpu_cache_backend_check
( export KVPQ_QUICK=1; step memcheck_cache_backend timeout 420 compute-sanitizer --tool memcheck --error-exitcode 99 \
    bins/gpu_cache_backend_check ) &
step gpu_check timeout 420 bins/gpu_check
wait
date -u | tee -a $O/env.txt
grep -v "^  " $O/cache_backend_check.log | tail -n 8; grep "^  " $O/cache_backend_check.log | head -n 40
tail -n 4 $O/memcheck_cache_backend.log $O/gpu_check.log
cat $O/summary.txt
