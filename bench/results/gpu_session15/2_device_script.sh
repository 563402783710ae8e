#!/bin/bash
# device call 2 (GPU engineer, session 15): the full build of branch gpu (nvcc 13.0 on the development machine,
# -DKVPQ_CUDA=ON -DCMAKE_BUILD_TYPE=Release -DKVPQ_TESTS=OFF -DKVPQ_WERROR=ON -DCMAKE_CUDA_ARCHITECTURES=90-real;
# defaults unchanged: attend_tc_regs 0, attend_tc_heads 0), carried as .dev-gpu/bins/full.txz.
# bench/gpu_bench.py (ours = the previous default, SDPA fp16 and the new variants in one process), then
# gpu_bench_kernels attends twice more (variants 5, a, c, d, e: spread between runs), then the encode shapes.
set -u
R=$(pwd); D=$R/.dev-gpu; O=$OUT; F=/tmp/full
mkdir -p $F && tar xJf $D/bins/full.txz -C $F
export LD_LIBRARY_PATH=$D/libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PYTHONUNBUFFERED=1
date -u | tee $O/env.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee -a $O/env.txt
python3 -c "import torch; print('torch', torch.__version__)" | tee -a $O/env.txt
t0=$SECONDS; KVPQ_BENCH_ATTEND_VARIANTS=59abcde timeout 200 python3 bench/gpu_bench.py --bin $F/gpu_bench_kernels --out /tmp/bench > $O/bench.log 2>&1; echo "gpu_bench exit $? $((SECONDS-t0)) s" | tee -a $O/env.txt
cp /tmp/bench/results.json $O/bench_results.json; cp /tmp/bench/table.md $O/bench_table.md
for i in 1 2; do
  t0=$SECONDS; KVPQ_BENCH_ATTEND_VARIANTS=5abcde timeout 150 $F/gpu_bench_kernels attends > $O/attends_$i.jsonl 2>&1; echo "attends $i exit $? $((SECONDS-t0)) s" | tee -a $O/env.txt
done
date -u | tee -a $O/env.txt
python3 $D/s15/summarize_ab.py run1=$O/attends_1.jsonl run2=$O/attends_2.jsonl | tee $O/ab.md
grep -B2 -A10 "session 15" $O/bench_table.md
grep -A6 "^| S | H" $O/bench_table.md
