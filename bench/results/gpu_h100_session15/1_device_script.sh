#!/bin/bash
# NEVER RUN: planned as the first call of session 15 (dev-build A/B); no machine started for it, and the
# one call that ran (2_device_script.sh) measured the same variants in the full build instead.
# device call 1 (GPU engineer, session 15): A/B of the attention levers in -DKVPQ_ATTEND_DEV_SHAPES builds
# (head_dim 128, 1/2/4 query heads per CTA; nvcc 13.0 on the development machine, -DKVPQ_CUDA=ON
# -DCMAKE_BUILD_TYPE=Release -DKVPQ_TESTS=OFF -DCMAKE_CUDA_ARCHITECTURES=90-real): base = the branch point
# (main 6f4831e), new = the tree with kernels.attend_tc_regs / attend_tc_heads. `gpu_bench_kernels attends`
# alternated base, new, base, new; then bench/gpu_bench.py --attend-only on new (SDPA in the same process).
set -u
R=$(pwd); D=$R/.dev-gpu; O=$OUT; B=$D/bins
export LD_LIBRARY_PATH=$D/libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
date -u | tee $O/env.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee -a $O/env.txt
python3 -c "import torch; print('torch', torch.__version__)" | tee -a $O/env.txt
for i in 1 2; do
  t0=$SECONDS; KVPQ_BENCH_ATTEND_VARIANTS=59 timeout 120 $B/base_dev_gpu_bench_kernels attends > $O/base_$i.jsonl 2>&1; echo "base $i exit $? $((SECONDS-t0)) s" | tee -a $O/env.txt
  t0=$SECONDS; KVPQ_BENCH_ATTEND_VARIANTS=59abcde timeout 170 $B/new_dev_gpu_bench_kernels attends > $O/new_$i.jsonl 2>&1; echo "new $i exit $? $((SECONDS-t0)) s" | tee -a $O/env.txt
done
export PYTHONUNBUFFERED=1
t0=$SECONDS; KVPQ_BENCH_ATTEND_VARIANTS=5ac timeout 120 python3 bench/gpu_bench.py --attend-only --bin $B/new_dev_gpu_bench_kernels --out /tmp/sdpa > $O/sdpa.log 2>&1; echo "gpu_bench exit $? $((SECONDS-t0)) s" | tee -a $O/env.txt
cp /tmp/sdpa/results.json $O/sdpa_results.json 2>/dev/null
date -u | tee -a $O/env.txt
python3 $D/s15/summarize_ab.py base1=$O/base_1.jsonl new1=$O/new_1.jsonl base2=$O/base_2.jsonl new2=$O/new_2.jsonl | tee $O/ab.md
grep -A10 "session 15" $O/sdpa.log
