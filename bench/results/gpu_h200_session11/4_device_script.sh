#!/bin/bash
# device call 4 (device helper, session 11): the final tree of branch `device`: per-layer bench
# (encode + attention; SDPA, PyTorch baselines and the HBM copy ceiling in the same process) and the
# 32-layer decode step (SDPA eager / graph in the same process; cffi travels as wheels).
set -u
cd "$(dirname "$0")/../../.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
B=../build-cuda; export LD_LIBRARY_PATH=$PWD/../libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
date -u | tee $OUT/env.txt; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee -a $OUT/env.txt
python3 -c "import torch; print('torch', torch.__version__)" | tee -a $OUT/env.txt
t0=$SECONDS
timeout 300 python3 bench/gpu_bench.py --bin $B/gpu_bench_kernels --out $OUT/bench > $OUT/bench.log 2>&1; echo "gpu_bench exit $? in $((SECONDS-t0)) s"
t0=$SECONDS
timeout 200 python3 bench/gpu_decode_step.py --lib $B/libkvpq.so --out $OUT/step > $OUT/step.log 2>&1; echo "decode_step exit $? in $((SECONDS-t0)) s"
date -u
cd $OUT && tar czf res.tgz bench step bench.log step.log env.txt 2>/dev/null
grep -A5 "^| S | H | D" $OUT/bench/table.md | head -6
grep -A8 "^| B | context | SDPA fp16 | SDPA GB" $OUT/bench/table.md | head -8
grep -A8 "^| B | context | SDPA eager" $OUT/step/decode_step.md
python3 - $OUT/bench/results.json <<'PY'
import json,sys
d=json.load(open(sys.argv[1]))
for e in (d.get('encode') or []):
    print('encode', e['S'], e['H'], e['D'], e['dsub'], 'variant_us', e.get('variant_us'))
PY
tail -3 $OUT/step.log | cut -c1-300
