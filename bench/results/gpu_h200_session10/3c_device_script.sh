#!/bin/bash
# device call 3c (device helper, session 10): the 32-layer decode step on the final tree (call 3's
# run stopped at `import cffi`: the device image has no cffi; its wheels travel in ../whl).
set -u
cd "$(dirname "$0")/../../.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
B=build-cuda; export LD_LIBRARY_PATH=$PWD/../libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
date -u | tee $OUT/env.txt; nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv | tee -a $OUT/env.txt
t0=$SECONDS
timeout 200 python3 bench/gpu_decode_step.py --lib $B/libkvpq.so --out $OUT/step > $OUT/step.log 2>&1; echo "decode_step exit $? in $((SECONDS-t0)) s"
date -u
grep -A9 "^| B | context | SDPA eager" $OUT/step/decode_step.md
tail -3 $OUT/step.log | cut -c1-300
