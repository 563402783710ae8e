#!/bin/bash
# device call 4a (GPU engineer, session 12), final tree, checks: tests/gpu/run_gpu_tests.sh (gpu_check,
# compute-sanitizer memcheck and racecheck at the same time; KVPQ_GPU_PARALLEL=1 KVPQ_NO_BENCH=1) on the full
# build of branch gpu made on the development machine (nvcc 13.0, -DKVPQ_CUDA=ON -DCMAKE_BUILD_TYPE=Release
# -DKVPQ_TESTS=OFF -DKVPQ_WERROR=ON -DCMAKE_CUDA_ARCHITECTURES=90-real; targets kvpq_shared gpu_check
# gpu_bench_kernels), the branch's scripts in .dev-gpu/tree.
set -u
D=$(cd "$(dirname "$0")" && pwd); O=/tmp/o; rm -rf $O; mkdir -p $O
export LD_LIBRARY_PATH=$D/libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
date -u | tee $O/env.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee -a $O/env.txt
compute-sanitizer --version | tail -1 | tee -a $O/env.txt
cd $D/tree
t0=$SECONDS
KVPQ_GPU_PARALLEL=1 KVPQ_NO_BENCH=1 timeout 450 tests/gpu/run_gpu_tests.sh $D/full $O/checks > $O/checks.out 2>&1; echo "run_gpu_tests exit $? in $((SECONDS-t0)) s" | tee -a $O/env.txt
date -u | tee -a $O/env.txt
grep -E "FAIL|passed|clean|skipped|seed" $O/checks.out | head -12
tail -n 2 $O/checks/sanitizer_memcheck.log $O/checks/sanitizer_racecheck.log 2>/dev/null
cat $O/checks/*.status 2>/dev/null
cd $O && tar czf $OUT/checks.tgz . ; cp $O/checks.out $O/env.txt $OUT/
