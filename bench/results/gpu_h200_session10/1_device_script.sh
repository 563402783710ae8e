#!/bin/bash
# device call 1 (device helper, session 10): the tensor-core attention kernel at main ("base") and
# with the software-pipelined tile loop ("new", a KVPQ_ATTEND_DEV_SHAPES build: head_dim 128, 4 heads
# per CTA only): output hashes (same arithmetic -> same bits), CUDA-graph timings alternated, and
# Nsight Compute (full set + stall reasons + shared-memory wavefronts) at b8@32k, b1@32k, b1@4k.
set -u
cd "$(dirname "$0")/../../.."
export PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=$PWD/libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
date -u | tee $OUT/env.txt; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee -a $OUT/env.txt
ldd devbin/base/gpu_bench_kernels | grep "not found"
for s in "1 4096" "1 32768" "8 32768" "8 131072"; do
  for r in 1 2; do for v in base new; do
    echo "$v $s run $r: $(timeout 60 devbin/$v/gpu_bench_kernels attend $s | grep '"op"')" >> $OUT/times.txt
  done; done
done
python3 - $OUT/times.txt <<'PY'
import json,sys
for line in open(sys.argv[1]):
    tag,js=line.split(': ',1)
    try: d=json.loads(js)
    except Exception: print(tag,'FAILED',js[:200]); continue
    v=d['variant_us']
    print(f"{tag:22s} tc {v['tc']:8.2f} tc8 {v['tc_8warps']:8.2f} tc16 {v['tc_16warps']:8.2f} nopdl {v['tc_nopdl']:8.2f}  fnv {' '.join(x[:8] for x in d['out_fnv'])}")
PY
M=smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts.sum,smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed,sm__cycles_active.avg
for job in "base 8 32768" "new 8 32768" "base 1 32768" "new 1 32768" "base 1 4096"; do
  set -- $job; v=$1; n=${v}_$2_$3
  t0=$SECONDS
  timeout 120 ncu --clock-control none -k regex:attend_tc_kernel -c 1 --set full --metrics $M --print-details all devbin/$v/gpu_bench_kernels attend $2 $3 > $OUT/ncu_$n.txt 2>&1
  echo "== ncu $job exit $? in $((SECONDS-t0)) s"
  grep -E "  Duration|Registers Per|Achieved Occupancy|No Eligible|Issued Warp|L1/TEX Cache Throughput|Compute \(SM\) Thr|DRAM Throughput|Grid Size|Block Size" $OUT/ncu_$n.txt | sed 's/  */ /g' | head -11
  grep -E "stalled_(short_scoreboard|mio_throttle|long_scoreboard|math_pipe|barrier|wait|not_selected|lg_throttle|dispatch|no_instruction|branch|selected)|wavefronts|bank_conflicts|hmma|inst_executed.sum|cycles_active" $OUT/ncu_$n.txt | sed 's/  */ /g;s/smsp__average_warps_issue_stalled_//;s/_per_issue_active.ratio//' | head -22
done
