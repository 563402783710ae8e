#!/bin/bash
# device call 3 (device helper, session 10): the final tree of branch `device` (attention kernels as at
# main; built on the development machine, nvcc 13.0, sm_90): per-layer bench (encode + attention, SDPA
# and the HBM copy ceiling in the same process) and the 32-layer decode step (SDPA eager / graph in the
# same process). Run from the staged tree root (.gpuwt-device/tree).
set -u
cd "$(dirname "$0")/../../.."
export PYTHONUNBUFFERED=1
B=build-cuda; export LD_LIBRARY_PATH=$PWD/../libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
date -u | tee $OUT/env.txt; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee -a $OUT/env.txt
python3 -c "import torch; print('torch', torch.__version__)" | tee -a $OUT/env.txt
for f in $B/gpu_check $B/gpu_bench_kernels $B/libkvpq.so; do ldd $f | grep "not found"; done
t0=$SECONDS
timeout 300 python3 bench/gpu_bench.py --bin $B/gpu_bench_kernels --out $OUT/bench > $OUT/bench.log 2>&1; echo "gpu_bench exit $? in $((SECONDS-t0)) s"
t0=$SECONDS
timeout 200 python3 bench/gpu_decode_step.py --lib $B/libkvpq.so --out $OUT/step > $OUT/step.log 2>&1; echo "decode_step exit $? in $((SECONDS-t0)) s"
date -u
cd $OUT && tar czf res.tgz bench step bench.log step.log env.txt 2>/dev/null
grep -B2 -A30 "Attention kernel variants" $OUT/bench/table.md | head -60
grep -A10 "^| B | context | SDPA fp16" $OUT/bench/table.md | head -9
grep -i -A6 "encode" $OUT/bench/table.md | head -24
grep -A9 "^| B | context | SDPA eager" $OUT/step/decode_step.md
tail -3 $OUT/step.log | cut -c1-300
