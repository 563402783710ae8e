#!/bin/bash
# device call 4b (GPU engineer, session 12), final tree, numbers: bench/gpu_bench.py (ours vs SDPA and the
# other baselines in one process; the tensor-core kernel with the cluster merge ("tc", default) and with
# main's device-memory merge ("tc_nocluster", the kernel of main) side by side), main's
# KVPQ_ATTEND_DEV_SHAPES gpu_bench_kernels `attends` once for a cross-check, bench/gpu_decode_step.py.
# Binaries as in 4a; cffi / pycparser wheels for the Python binding.
set -u
D=$(cd "$(dirname "$0")" && pwd); O=/tmp/o; rm -rf $O; mkdir -p $O
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $D/whl/*.whl && export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1 LD_LIBRARY_PATH=$D/libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} KVPQ_INCLUDE=$D/tree/include
date -u | tee $O/env.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee -a $O/env.txt
python3 -c "import torch; print('torch', torch.__version__)" | tee -a $O/env.txt
cd $D/tree
t0=$SECONDS
timeout 200 python3 bench/gpu_bench.py --bin $D/full/gpu_bench_kernels --out $O/bench > $O/bench.log 2>&1; echo "gpu_bench exit $? in $((SECONDS-t0)) s" | tee -a $O/env.txt
t0=$SECONDS
timeout 60 $D/bin/base/gpu_bench_kernels attends > $O/attends_main_dev.txt 2>&1; echo "main dev attends exit $? in $((SECONDS-t0)) s" | tee -a $O/env.txt
t0=$SECONDS
timeout 120 python3 bench/gpu_decode_step.py --lib $D/full/libkvpq.so --out $O/step > $O/step.log 2>&1; echo "decode_step exit $? in $((SECONDS-t0)) s" | tee -a $O/env.txt
date -u | tee -a $O/env.txt
grep -A8 "^| B | context | SDPA fp16 | SDPA GB" $O/bench/table.md | head -8
grep -B2 -A8 "tensor cores, split merge" $O/bench/table.md | head -12
grep -A5 "^| S | H | D" $O/bench/table.md | head -6
grep -A8 "^| B | context | SDPA eager" $O/step/decode_step.md
python3 - $O/attends_main_dev.txt <<'PY'
import json,sys
for line in open(sys.argv[1]):
    if line.startswith('{"op"'):
        d=json.loads(line.replace(': inf',': null')); v=d['variant_us']
        print('main-dev', d['op'], d['B'], d['L'], 'tc', v['tc'], 'tc8', v['tc_8warps'], 'tc16', v['tc_16warps'])
PY
tail -3 $O/step.log | cut -c1-300
cd $O && tar czf $OUT/bench.tgz . ; cp $O/bench.log $O/step.log $O/env.txt $OUT/ 2>/dev/null
