#!/bin/bash
# device call 3 (GPU engineer, session 15): checks of the full build (as call 2): tests/gpu/run_gpu_tests.sh with
# KVPQ_GPU_PARALLEL=1 KVPQ_NO_BENCH=1 (gpu_check: every encode and attention variant, 9 = attend_tc_regs toggled,
# a = 2 query heads per CTA; memcheck every variant; racecheck attention variants 5, 7 and 9: the default,
# 16-warp CTAs, and code rows in registers).
set -u
R=$(pwd); D=$R/.dev-gpu; O=$OUT; F=/tmp/full
[ -x $F/gpu_check ] || { mkdir -p $F && tar xJf $D/bins/full.txz -C $F; }
export LD_LIBRARY_PATH=$D/libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
date -u | tee $O/env.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a $O/env.txt
compute-sanitizer --version | tail -1 | tee -a $O/env.txt
t0=$SECONDS
KVPQ_RACECHECK_ATTEND=579 KVPQ_GPU_PARALLEL=1 KVPQ_NO_BENCH=1 timeout 540 tests/gpu/run_gpu_tests.sh $F /tmp/checks > $O/checks.out 2>&1; echo "run_gpu_tests exit $? in $((SECONDS-t0)) s" | tee -a $O/env.txt
grep -E "FAIL|passed|clean|skipped|seed" $O/checks.out | head -12
cat /tmp/checks/*.status 2>/dev/null
cp /tmp/checks/gpu_check.log $O/ 2>/dev/null; tail -40 /tmp/checks/sanitizer_memcheck.log > $O/memcheck_tail.log 2>/dev/null; tail -40 /tmp/checks/sanitizer_racecheck.log > $O/racecheck_tail.log 2>/dev/null
grep -E "relative|rel " /tmp/checks/gpu_check.log | tail -5
date -u | tee -a $O/env.txt
