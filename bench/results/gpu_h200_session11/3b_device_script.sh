#!/bin/bash
# device call 3b (device helper, session 11): the tensor-core attention kernel at main ("base") against
# window CTAs ("new": at small batch the window gets CTAs of its own, one position per warp, in the same
# wave as the code CTAs, instead of each code CTA merging its share after its tiles), both
# KVPQ_ATTEND_DEV_SHAPES builds; alternated 3 times. Output bits differ (window merge order).
set -u
cd "$(dirname "$0")/../../.."
export LD_LIBRARY_PATH=$PWD/../libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
date -u; nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader
for s in "1 4096" "1 32768" "8 4096" "8 32768" "1 4096 ne"; do
  for r in 1 2 3; do for v in base new; do
    echo "$v $s run $r: $(timeout 60 ../devbin/$v/gpu_bench_kernels attend $s 2>&1 | grep -E '"op"|rror' | head -2)" >> $OUT/times.txt
  done; done
done
python3 - $OUT/times.txt <<'PY'
import json,sys
for line in open(sys.argv[1]):
    tag,js=line.split(': ',1)
    try: d=json.loads(js)
    except Exception: print(tag,'FAILED',js[:300]); continue
    v=d['variant_us']
    print(f"{tag:24s} tc {v['tc']:7.2f} tc8 {v['tc_8warps']:7.2f} tc16 {v['tc_16warps']:7.2f} nopdl {v['tc_nopdl']:7.2f} fnv {' '.join(x[:8] for x in d['out_fnv'])}")
PY
