#!/bin/bash
# device call 5 (device helper, session 10): racecheck of the default tensor-core attention kernel
# alone (call 4's full racecheck ran past its 520 s limit inside the LUT variants), within the
# session's remaining device time.
set -u
cd "$(dirname "$0")/../../.."
B=build-cuda; export LD_LIBRARY_PATH=$PWD/../libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
date -u
t0=$SECONDS
KVPQ_QUICK=1 KVPQ_ENCODE_VARIANTS= KVPQ_ATTEND_VARIANTS=5 timeout 170 compute-sanitizer --tool racecheck --error-exitcode 99 $B/gpu_check > $OUT/racecheck_tc.log 2>&1; echo "racecheck (tensor-core variant 5) exit $? in $((SECONDS-t0)) s"
grep -c "^  attend" $OUT/racecheck_tc.log; grep -i -E "hazard|ERROR SUMMARY|passed|FAIL" $OUT/racecheck_tc.log | head
