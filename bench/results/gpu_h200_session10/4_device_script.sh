#!/bin/bash
# device call 4 (device helper, session 10): the checks on the final tree of branch `device`, last:
# gpu_check, compute-sanitizer memcheck and racecheck at the same time (KVPQ_GPU_PARALLEL=1), after a
# second run of the 32-layer decode step.
set -u
cd "$(dirname "$0")/../../.."
B=build-cuda; export LD_LIBRARY_PATH=$PWD/../libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
date -u | tee $OUT/env.txt
# the decode step once more first (call 3c's eager-SDPA b1@4k figure was twice session 7's)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../whl/*.whl && export PYTHONPATH=/tmp/site
PYTHONUNBUFFERED=1 timeout 60 python3 bench/gpu_decode_step.py --lib $B/libkvpq.so --out $OUT/step2 > $OUT/step2.log 2>&1; echo "decode_step exit $?"
grep -A8 "^| B | context | SDPA eager" $OUT/step2/decode_step.md
t0=$SECONDS
KVPQ_GPU_PARALLEL=1 KVPQ_NO_BENCH=1 timeout 520 tests/gpu/run_gpu_tests.sh $B $OUT/checks > $OUT/checks.out 2>&1; echo "run_gpu_tests exit $? in $((SECONDS-t0)) s"
date -u
grep -E "FAIL|passed|clean|skipped|seed" $OUT/checks.out | head -20
tail -2 $OUT/checks/sanitizer_memcheck.log $OUT/checks/sanitizer_racecheck.log
cd $OUT/checks && tar czf $OUT/checks.tgz . 2>/dev/null; true
