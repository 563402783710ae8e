#!/bin/bash
# The GPU session of issue 36 item 1 (one cache API), one device call, run from the carried folder
# (.dev-gpu: this branch's tree plus bins/ built on the development machine with nvcc 13.0,
# -DKVPQ_CUDA=ON -DCMAKE_BUILD_TYPE=Release -DKVPQ_WERROR=ON -DCMAKE_CUDA_ARCHITECTURES=90-real, and
# libs/: the shared libraries the binaries need that the device lacks; data/: SmolLM2-135M cut to its
# first 4 blocks by bench/gguf_slice_layers.py and a codebook calibrated on it here).
# Usage: bash bench/results/gpu_cache_backend/device_script.sh OUT
set -u
O=${1:-$OUT}; B=bins; D=data
export LD_LIBRARY_PATH=$(pwd)/libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
date -u | tee $O/env.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee -a $O/env.txt
step() { local name=$1; shift; local t0=$SECONDS; "$@" > $O/$name.log 2>&1; local st=$?
         echo "$name: exit $st in $((SECONDS - t0)) s" | tee -a $O/summary.txt; }
# 1. the unified API on the GPU against the CPU cache (full sizes), then memcheck (quick sizes),
#    with gpu_check (the existing suite, full) beside the sanitizer run
step cache_backend_check $B/gpu_cache_backend_check
( KVPQ_QUICK=1 step memcheck_cache_backend compute-sanitizer --tool memcheck --error-exitcode 99 $B/gpu_cache_backend_check ) &
p1=$!
step gpu_check $B/gpu_check
wait $p1
# 2. the CLI: ppl and greedy generate with the cache on the CPU and on the GPU (model on the CPU)
T=$D/persuasion.txt; M=$D/smol4.gguf; CB=$D/smol4_cb.safetensors
for spec in "vq:$CB" "vq:$CB:cuda"; do
  tag=$( [ "${spec%:cuda}" != "$spec" ] && echo cuda || echo cpu )
  step ppl_$tag $B/kvpq ppl --model $M --text $T --ctx 512 --chunks 4 --cache $spec --threads 16 --quiet
  step gen_$tag $B/kvpq generate --model $M --prompt "It was a truth universally acknowledged" -n 48 --temp 0 \
       --cache $spec --print-ids --threads 16
done
# KL(cpu cache || cuda cache) per scored token and top-1 agreement on the same chunks
step ppl_kl $B/kvpq ppl --model $M --text $T --ctx 512 --chunks 4 --cache "vq:$CB:cuda" --kl-base "vq:$CB" --threads 16 --quiet
cmp -s $O/gen_cpu.log $O/gen_cuda.log && echo "generate: same token ids on cpu and cuda" | tee -a $O/summary.txt \
  || echo "generate: token ids differ" | tee -a $O/summary.txt
date -u | tee -a $O/env.txt
tail -n 25 $O/cache_backend_check.log
tail -n 3 $O/memcheck_cache_backend.log $O/gpu_check.log
tail -n 4 $O/ppl_cpu.log $O/ppl_cuda.log $O/ppl_kl.log
cat $O/gen_cpu.log $O/gen_cuda.log | head -8
cat $O/summary.txt
