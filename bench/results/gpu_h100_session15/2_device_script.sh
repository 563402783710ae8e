#!/bin/bash
# As run (10:47-10:50 UTC, NVIDIA H100 80GB HBM3, the one call of the session that got a machine; 17 earlier
# tries got none): `bash .dev-gpu/s15/2_device_script.sh 220 0` from the root of the main checkout, so step 2
# was skipped (arg 0), the checks got 161 s, and `bench/gpu_bench.py` was main's copy (same measurement code;
# no session-15 table, which levers_table.py makes from the JSON). Logs: 2/.
# device call 2 (GPU engineer, session 15; the only call that got a machine): the full build of branch gpu
# (nvcc 13.0 on the development machine, -DKVPQ_CUDA=ON -DCMAKE_BUILD_TYPE=Release -DKVPQ_TESTS=OFF
# -DKVPQ_WERROR=ON -DCMAKE_CUDA_ARCHITECTURES=90-real; defaults unchanged: attend_tc_regs 0, attend_tc_heads 0),
# carried as .dev-gpu/bins/full.txz.
#  1. bench/gpu_bench.py: encode shapes, attention ours (= the previous default) with SDPA fp16 and the new
#     variants (a: code rows in registers, c: 2 heads per CTA, d: 1 head per CTA, e: a + c; 9: no cluster) in
#     one process;
#  2. gpu_bench_kernels attends once more (variants 5, a, c, d, e) for the run-to-run spread;
#  3. tests/gpu/run_gpu_tests.sh KVPQ_GPU_PARALLEL=1 KVPQ_NO_BENCH=1 in what is left of the call, the
#     tensor-core attention variants only (device time was short; encode is unchanged this session):
#     KVPQ_ENCODE_VARIANTS=9 (none) KVPQ_ATTEND_VARIANTS=56789a for gpu_check and memcheck (9 = attend_tc_regs
#     toggled, a = 2 query heads per CTA), racecheck attention variants 5 and 9 (with its usual few encode shapes).
set -u
R=$(pwd); D=$R/.dev-gpu; O=$OUT; F=/tmp/full
mkdir -p $F && tar xJf $D/bins/full.txz -C $F
export LD_LIBRARY_PATH=$D/libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PYTHONUNBUFFERED=1
date -u | tee $O/env.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee -a $O/env.txt
python3 -c "import torch; print('torch', torch.__version__)" | tee -a $O/env.txt
compute-sanitizer --version | tail -1 | tee -a $O/env.txt
t0=$SECONDS; KVPQ_BENCH_ATTEND_VARIANTS=59acde timeout 170 python3 bench/gpu_bench.py --bin $F/gpu_bench_kernels --out /tmp/bench > $O/bench.log 2>&1; echo "gpu_bench exit $? $((SECONDS-t0)) s" | tee -a $O/env.txt
cp /tmp/bench/results.json $O/bench_results.json; cp /tmp/bench/table.md $O/bench_table.md
[ "${2:-1}" = 1 ] && t0=$SECONDS && KVPQ_BENCH_ATTEND_VARIANTS=5acde timeout 90 $F/gpu_bench_kernels attends > $O/attends_2.jsonl 2>&1; echo "attends exit $? $((SECONDS-t0)) s" | tee -a $O/env.txt
date -u | tee -a $O/env.txt
grep -B2 -A10 "session 15" $O/bench_table.md
grep -A5 "^| S | H" $O/bench_table.md | cut -c1-160
python3 $D/s15/summarize_ab.py run2=$O/attends_2.jsonl > $O/ab.md
left=$((${1:-575} - SECONDS)); echo "checks get $left s" | tee -a $O/env.txt
t0=$SECONDS
KVPQ_ENCODE_VARIANTS=9 KVPQ_ATTEND_VARIANTS=56789a KVPQ_RACECHECK_ATTEND=59 KVPQ_GPU_PARALLEL=1 KVPQ_NO_BENCH=1 timeout $left tests/gpu/run_gpu_tests.sh $F /tmp/checks > /tmp/checks.out 2>&1; echo "run_gpu_tests exit $? in $((SECONDS-t0)) s" | tee -a $O/env.txt
cat /tmp/checks/*.status 2>/dev/null | tee -a $O/env.txt
cd /tmp && tar czf $OUT/checks.tgz checks checks.out 2>/dev/null
grep -E "FAIL|passed|clean|seed" /tmp/checks.out | head -12
date -u | tee -a $O/env.txt
