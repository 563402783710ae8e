#!/bin/bash
# Device call 1 (session 20, issue 30 item 3 on CUDA): keys coded before RoPE in kvpq_cuda_cache
# (src/cuda/rope.cu). bins/ built on the development machine (nvcc 13, -DKVPQ_CUDA=ON
# -DCMAKE_BUILD_TYPE=Release -DKVPQ_WERROR=ON -DCMAKE_CUDA_ARCHITECTURES=90-real), xz; libs/
# libcjson. Steps: the backend check (rope configs beside the others) at full sizes; memcheck and
# racecheck of it (KVPQ_QUICK) beside gpu_check (full); the attention bench, rope kernel vs the
# default kernel, with fp16 SDPA from PyTorch in the same call (sdpa.py: bench/gpu_bench.py's
# torch_sdpa at B 1/8, L 4096/32768). Run from the repository root: bash run.sh $OUT
set -u
cd "$(dirname "$0")"
O=$1
for f in bins/*.xz libs/*.xz; do
  [ -e "${f%.xz}" ] || python3 -c "import lzma, sys; open(sys.argv[2], 'wb').write(lzma.open(sys.argv[1]).read())" "$f" "${f%.xz}"
done
chmod +x bins/* 2>/dev/null
export LD_LIBRARY_PATH=$(pwd)/libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
date -u | tee -a $O/env.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee -a $O/env.txt
step() { local name=$1; shift; local t0=$SECONDS; "$@" > $O/$name.log 2>&1; local st=$?
         echo "$name: exit $st in $((SECONDS - t0)) s" | tee -a $O/summary.txt; }
step cache_backend_check timeout 200 bins/gpu_cache_backend_check
( export KVPQ_QUICK=1
  step memcheck timeout 300 compute-sanitizer --tool memcheck --error-exitcode 99 bins/gpu_cache_backend_check
  step racecheck timeout 300 compute-sanitizer --tool racecheck --error-exitcode 99 bins/gpu_cache_backend_check ) &
step gpu_check timeout 330 bins/gpu_check
wait
for B in 1 8; do for L in 4096 32768; do
  for m in rope plain; do
    a=""; [ $m = rope ] && a=rope
    KVPQ_BENCH_ATTEND_VARIANTS=5 timeout 60 bins/gpu_bench_kernels attend $B $L $a >> $O/bench.jsonl 2>>$O/bench.err
  done
done; done
timeout 120 python3 sdpa.py >> $O/bench.jsonl 2>>$O/bench.err
