#!/bin/bash
# device call 2 (device helper, session 11): encode variants 3 (main's default), 5 (A registers by
# index, 4 row tiles, 3 CTAs/SM) and 6 (the same with 2 row tiles, 4 CTAs/SM; the persistent kernel of
# call 1 is gone) in one process, 3 runs, with the leave-out knobs of 3 and 5 (dbg 1: no mma loop,
# 2: no re-rank, 3: neither, 4: no search at all); exactness and racecheck of variant 6 (dev build's
# gpu_check: encode checks only); ncu of 3 / 5 / 6 at the OOM shape.
set -u
cd "$(dirname "$0")/../../.."
export PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=$PWD/../libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
D=../devbin
date -u | tee $OUT/env.txt; nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader | tee -a $OUT/env.txt
for r in 1 2 3; do timeout 90 $D/new/gpu_bench_kernels encodes_knobs 2>&1 | grep '"op"' | sed "s/^/run $r: /" >> $OUT/encode_times.txt; done
python3 - $OUT/encode_times.txt <<'PY'
import json,sys
for line in open(sys.argv[1]):
    tag,js=line.split(': ',1); d=json.loads(js); v=d['variant_us']; k=d['knob_us']
    print(f"{tag} S={d['S']:5d} D={d['D']} dsub={d['dsub']}: " + ' '.join(f"v{i} {x:6.2f}" for i,x in enumerate(v)) + f" | knobs v3 {k['v3']} v5 {k['v5']}")
PY
t0=$SECONDS
KVPQ_ENCODE_VARIANTS=6 KVPQ_ATTEND_VARIANTS=9 timeout 100 $D/new/gpu_check > $OUT/gpu_check_encode6.log 2>&1; echo "gpu_check (dev build, encode 6) exit $? in $((SECONDS-t0)) s"
grep -E "FAIL|passed|seed|variant" $OUT/gpu_check_encode6.log | head -8
t0=$SECONDS
KVPQ_QUICK=1 KVPQ_ENCODE_VARIANTS=6 KVPQ_ENCODE_SHAPES=few KVPQ_ATTEND_VARIANTS=9 timeout 100 compute-sanitizer --tool racecheck --error-exitcode 99 $D/new/gpu_check > $OUT/racecheck_encode6.log 2>&1
echo "racecheck (encode 6 few) exit $? in $((SECONDS-t0)) s: $(grep -E 'RACECHECK SUMMARY' $OUT/racecheck_encode6.log | tail -1)"
M=smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,gpu__time_duration.sum
for v in 3 5 6; do
  t0=$SECONDS
  timeout 90 ncu --clock-control none --kernel-name-base demangled -k "regex:encode_kernel<.int.256, .int.4, .int.$v>" -c 1 --metrics $M $D/new/gpu_bench_kernels encode_oom > $OUT/ncu_v$v.txt 2>&1
  echo "== ncu variant $v exit $? in $((SECONDS-t0)) s"
  grep -E "inst_executed|issue_active|hmma|pipe_alu|dram__|wavefronts|warps_active|stalled|duration" $OUT/ncu_v$v.txt | sed 's/  */ /g;s/smsp__average_warps_issue_stalled_//;s/_per_issue_active.ratio//'
done
date -u
