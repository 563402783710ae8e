#!/bin/bash
# Device call 3 of issue 36 item 1: gpu_check under compute-sanitizer memcheck (KVPQ_QUICK sizes,
# every variant, as tests/gpu/run_gpu_tests.sh runs it), beside a second run of
# gpu_cache_backend_check (a fresh seed). The binaries of tests_device.sh. Run as:
# bash .dev-gpu/sanitizer_device.sh $OUT
set -u
source "$(dirname "$0")/common.sh" "$1"
( export KVPQ_QUICK=1; step memcheck_gpu_check timeout 500 compute-sanitizer --tool memcheck --error-exitcode 99 \
    bins/gpu_check ) &
step cache_backend_check_2 timeout 240 bins/gpu_cache_backend_check
wait
date -u | tee -a $O/env.txt
head -n 1 $O/cache_backend_check_2.log; tail -n 1 $O/cache_backend_check_2.log
tail -n 3 $O/memcheck_gpu_check.log
cat $O/summary.txt
