#!/bin/bash
# device call 1 (device helper, session 11): encode search variants 5 (A registers loaded by index)
# and 6 (variant 5 in a persistent, double-buffered kernel) against main's default (variant 3) in the
# same process, exactness (gpu_check encode checks of 6 and 5; attention variants off), racecheck and
# memcheck of the encode variants 6/5 on the few shapes, ncu of variants 3 / 5 / 6 at the OOM shape; and
# the tensor-core attention kernel at main ("base", KVPQ_ATTEND_DEV_SHAPES build) against this tree's
# ("new": window rows staged in shared memory before the PDL wait, fence.acq_rel instead of
# __threadfence around the split counter, the last CTA's partials requested at once), alternated.
set -u
cd "$(dirname "$0")/../../.."
export PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=$PWD/../libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
D=../devbin
date -u | tee $OUT/env.txt; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee -a $OUT/env.txt
for f in $D/base/gpu_bench_kernels $D/new/gpu_bench_kernels $D/full/gpu_check; do ldd $f | grep "not found"; done
# 1. encode timings, 3 runs (every variant in one process: variant_us[0..6])
for r in 1 2 3; do timeout 60 $D/new/gpu_bench_kernels encodes 2>&1 | grep '"op"' | sed "s/^/run $r: /" >> $OUT/encode_times.txt; done
python3 - $OUT/encode_times.txt <<'PY'
import json,sys
for line in open(sys.argv[1]):
    tag,js=line.split(': ',1); d=json.loads(js); v=d['variant_us']
    print(f"{tag} S={d['S']:5d} H={d['H']} D={d['D']} dsub={d['dsub']}: " + ' '.join(f"v{i} {x:7.2f}" for i,x in enumerate(v)) + f"  seed {d['seed_us']:.1f} api {d['api_us']:.1f}")
PY
# 2. attention base vs new, alternated
for s in "1 4096" "1 32768" "8 32768" "8 131072"; do
  for r in 1 2 3; do for v in base new; do
    echo "$v $s run $r: $(timeout 60 $D/$v/gpu_bench_kernels attend $s 2>&1 | grep -E '"op"|rror' | head -2)" >> $OUT/attend_times.txt
  done; done
done
python3 - $OUT/attend_times.txt <<'PY'
import json,sys
for line in open(sys.argv[1]):
    tag,js=line.split(': ',1)
    try: d=json.loads(js)
    except Exception: print(tag,'FAILED',js[:300]); continue
    v=d['variant_us']
    print(f"{tag:22s} tc {v['tc']:7.2f} tc8 {v['tc_8warps']:7.2f} tc16 {v['tc_16warps']:7.2f} nopdl {v['tc_nopdl']:7.2f} fnv {' '.join(x[:8] for x in d['out_fnv'])}")
PY
# 3. exactness of the new encode variants (full build's gpu_check: encode checks only)
t0=$SECONDS
KVPQ_ENCODE_VARIANTS=65 KVPQ_ATTEND_VARIANTS=9 timeout 200 $D/full/gpu_check > $OUT/gpu_check_encode.log 2>&1; echo "gpu_check (encode 6,5) exit $? in $((SECONDS-t0)) s"
grep -E "FAIL|passed|seed|beyond" $OUT/gpu_check_encode.log | head -8
# 4. sanitizers on the new encode variants, few shapes
for tool in racecheck memcheck; do
  t0=$SECONDS
  KVPQ_QUICK=1 KVPQ_ENCODE_VARIANTS=65 KVPQ_ENCODE_SHAPES=few KVPQ_ATTEND_VARIANTS=9 timeout 150 compute-sanitizer --tool $tool --error-exitcode 99 $D/full/gpu_check > $OUT/${tool}_encode.log 2>&1
  echo "$tool (encode 6,5 few) exit $? in $((SECONDS-t0)) s: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $OUT/${tool}_encode.log | tail -1)"
done
# 5. ncu at the OOM shape: variants 3, 5, 6
M=smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,gpu__time_duration.sum
for k in "encode_kernel<256, 4, 3>" "encode_kernel<256, 4, 5>" "encode_persist_kernel<256, 4>"; do
  n=$(echo "$k" | tr -dc 'a-z0-9_'); t0=$SECONDS
  timeout 90 ncu --clock-control none --kernel-name-base demangled -k "regex:${k}" -c 1 --metrics $M $D/new/gpu_bench_kernels encode_oom > $OUT/ncu_$n.txt 2>&1
  echo "== ncu $k exit $? in $((SECONDS-t0)) s"
  grep -E "inst_executed|issue_active|hmma|pipe_alu|dram__|wavefronts|warps_active|stalled|duration" $OUT/ncu_$n.txt | sed 's/  */ /g;s/smsp__average_warps_issue_stalled_//;s/_per_issue_active.ratio//'
done
date -u
