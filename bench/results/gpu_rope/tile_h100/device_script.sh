#!/bin/bash
# Device call 1 (session 20, issue 30 item 3 on CUDA): keys coded before RoPE in kvpq_cuda_cache
# (src/cuda/rope.cu). bins/ built on the development machine (nvcc 13, -DKVPQ_CUDA=ON
# -DCMAKE_BUILD_TYPE=Release -DKVPQ_WERROR=ON -DCMAKE_CUDA_ARCHITECTURES=90-real). Steps: the
# backend check (rope configs beside the others) at full sizes; memcheck and racecheck of its rope
# configs (KVPQ_QUICK) beside the attention bench (rope kernel vs the default kernel), then fp16
# SDPA from PyTorch in the same call. (The first call of the session also ran gpu_check: passed.) Run from the repository root: bash .dev-gpu/rope/run.sh $OUT
set -u
cd "$(dirname "$0")"
O=$1
for f in bins/*.xz libs/*.xz data/*.xz; do
  [ -e "$f" ] || continue
  [ -e "${f%.xz}" ] || python3 -c "import lzma, sys; open(sys.argv[2], 'wb').write(lzma.open(sys.argv[1]).read())" "$f" "${f%.xz}"
done
chmod +x bins/* 2>/dev/null
export LD_LIBRARY_PATH=$(pwd)/libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
date -u | tee -a $O/env.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee -a $O/env.txt
step() { local name=$1; shift; local t0=$SECONDS; "$@" > $O/$name.log 2>&1; local st=$?
         echo "$name: exit $st in $((SECONDS - t0)) s" | tee -a $O/summary.txt; }
step cache_backend_check timeout 200 bins/gpu_cache_backend_check
KVPQ_CONFIGS=rope KVPQ_ROPE_KERNEL=warp step cache_backend_check_warp timeout 100 bins/gpu_cache_backend_check
for BL in "1 4096" "1 32768" "8 4096" "8 32768"; do
  for m in tile warp plain; do
    a=rope; [ $m = plain ] && a=""
    [ $m = warp ] && [ "$BL" != "8 32768" ] && continue
    echo "{\"kernel\": \"$m\"}" >> $O/bench.jsonl
    KVPQ_ROPE_KERNEL=$m KVPQ_BENCH_ATTEND_VARIANTS=5 timeout 60 bins/gpu_bench_kernels attend $BL $a >> $O/bench.jsonl 2>>$O/bench.err
  done
done
timeout 120 python3 sdpa.py >> $O/bench.jsonl 2>>$O/bench.err
( export KVPQ_QUICK=1 KVPQ_CONFIGS=rope
  step memcheck timeout 240 compute-sanitizer --tool memcheck --error-exitcode 99 bins/gpu_cache_backend_check ) &
( export KVPQ_QUICK=1 KVPQ_CONFIGS=rope
  step racecheck timeout 240 compute-sanitizer --tool racecheck --error-exitcode 99 bins/gpu_cache_backend_check ) &
wait
date -u | tee -a $O/env.txt
grep -v "^  " $O/cache_backend_check.log | tail -n 12; grep "rope" $O/cache_backend_check.log | head -30; tail -n 4 $O/cache_backend_check_warp.log
tail -n 3 $O/memcheck.log $O/racecheck.log
grep -o '"kernel": "[a-z]*"\|"op": "[a-z_]*", "B": [0-9]*, "L": [0-9]*\|"ours_us": [0-9.]*\|"sdpa_us": [0-9.]*' $O/bench.jsonl | paste -sd' ' | sed 's/"kernel"/\n&/g'; tail -3 $O/bench.err
cat $O/summary.txt
