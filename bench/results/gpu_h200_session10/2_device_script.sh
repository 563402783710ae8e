#!/bin/bash
# device call 2 (device helper, session 10): tensor-core attention kernel at main ("base") against the
# same kernel with its code-row ring filled by bulk copies on mbarriers ("tma", a
# KVPQ_ATTEND_DEV_SHAPES build): output hashes (same arithmetic -> same bits, plain and norm-explicit),
# CUDA-graph timings alternated 3 times, and Nsight Compute at b8@32k.
set -u
cd "$(dirname "$0")/../../.."
export LD_LIBRARY_PATH=$PWD/libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
date -u | tee $OUT/env.txt; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee -a $OUT/env.txt
for s in "1 4096" "1 32768" "8 32768" "8 131072" "8 32768 ne" "1 4096 ne"; do
  for r in 1 2 3; do for v in base tma; do
    [ $r = 3 ] && [ "${s#*ne}" != "$s" ] && continue
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
    print(f"{tag:24s} tc {v['tc']:8.2f} tc8 {v['tc_8warps']:8.2f} tc16 {v['tc_16warps']:8.2f} nopdl {v['tc_nopdl']:8.2f}  fnv {' '.join(x[:8] for x in d['out_fnv'])}")
PY
M=smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__inst_executed.sum,smsp__issue_active.avg.per_cycle_active
for v in base tma; do
  timeout 60 ncu --clock-control none -k regex:attend_tc_kernel -c 1 --section SpeedOfLight --metrics $M devbin/$v/gpu_bench_kernels attend 8 32768 > $OUT/ncu_${v}_8_32768.txt 2>&1
  echo "== ncu $v b8@32k exit $?"; grep -E "  Duration|L1/TEX Cache|DRAM Through|stalled|wavefronts|inst_executed|issue_active" $OUT/ncu_${v}_8_32768.txt | sed 's/  */ /g;s/smsp__average_warps_issue_stalled_//;s/_per_issue_active.ratio//'
done
