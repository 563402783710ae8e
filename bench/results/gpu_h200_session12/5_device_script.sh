#!/bin/bash
# device call 5 (GPU engineer, session 12): the final tree after a host-side guard added after call 4 (a
# one-split launch takes the cluster kernel only where cudaOccupancyMaxActiveClusters answers >= 1, i.e. never
# below compute capability 9.0): gpu_check's attention checks (every tensor-core variant 5-8, no encode
# checks) and gpu_bench_kernels attend at b1@4k and b8@4k (quick: 4 launches per graph, 3 replays) on the full
# build (as in call 4).
set -u
D=$(cd "$(dirname "$0")" && pwd); O=/tmp/o; rm -rf $O; mkdir -p $O
export LD_LIBRARY_PATH=$D/libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
date -u | tee $O/env.txt
t0=$SECONDS
KVPQ_ENCODE_VARIANTS= KVPQ_ATTEND_VARIANTS=5678 timeout 150 $D/full/gpu_check > $O/gpu_check_attend.log 2>&1; echo "gpu_check (attention, variants 5-8) exit $? in $((SECONDS-t0)) s" | tee -a $O/env.txt
grep -E "FAIL|seed|all GPU" $O/gpu_check_attend.log | head -8
for s in "1 4096" "8 4096"; do timeout 60 $D/full/gpu_bench_kernels attend $s 2>&1 | grep '"op"' | sed 's/.*"variant_us": \({[^}]*}\).*/\1/' | tee -a $O/attend_quick.txt; done
cd $O && cp env.txt gpu_check_attend.log attend_quick.txt $OUT/
