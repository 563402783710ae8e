#!/bin/bash
# device call 3b (device helper, session 10): depth of the code-row ring of the tensor-core attention kernel
# nst3 / nst4 = a 3- / 4-tile code-row ring for 16-warp CTAs (3b_ring_depth.diff); base = main (2 tiles).
set -u
cd "$(dirname "$0")/../../.."
export LD_LIBRARY_PATH=$PWD/libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
date -u; nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader
for s in "1 4096" "1 32768" "8 32768" "8 131072"; do
  for r in 1 2 3; do for v in base nst3 nst4; do
    echo "$v $s run $r: $(timeout 60 devbin/$v/gpu_bench_kernels attend $s 2>&1 | grep -E '"op"|rror' | head -2)" >> $OUT/times.txt
  done; done
done
python3 - $OUT/times.txt <<'PY'
import json,sys
for line in open(sys.argv[1]):
    tag,js=line.split(': ',1)
    try: d=json.loads(js)
    except Exception: print(tag,'FAILED',js[:300]); continue
    v=d['variant_us']
    print(f"{tag:22s} tc {v['tc']:8.2f} tc8 {v['tc_8warps']:8.2f} tc16 {v['tc_16warps']:8.2f} nopdl {v['tc_nopdl']:8.2f}  fnv {d['out_fnv'][0][:8]}")
PY
