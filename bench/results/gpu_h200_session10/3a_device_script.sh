#!/bin/bash
# device call 3a (device helper, session 10): where the fixed cost of the tensor-core attention kernel
# goes, by leaving parts out (3_diagnostic_leave_out.diff; results are wrong on purpose, timings only):
# dbg1 = no codebook-image load, dbg2 = no code tiles (image, q', window, merges only); base = main.
set -u
cd "$(dirname "$0")/../../.."
export LD_LIBRARY_PATH=$PWD/libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
date -u; nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader
for s in "1 4096" "1 32768" "8 4096" "8 32768"; do
  for r in 1 2; do for v in base dbg1 dbg2; do
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
    print(f"{tag:22s} tc {v['tc']:8.2f} tc8 {v['tc_8warps']:8.2f} tc16 {v['tc_16warps']:8.2f} nopdl {v['tc_nopdl']:8.2f}")
PY
