#!/bin/bash
# device call 3 (gpu helper, session 7: merge and window-prefetch change): benches (PDL vs plain launch, SDPA), ncu, then the full checks
# (gpu_check + memcheck + racecheck in parallel). Run from the staged tree root.
set -u
cd "$(dirname "$0")"
export PYTHONUNBUFFERED=1
FINAL=$OUT; OUT=/tmp/res; mkdir -p $OUT
save() { tar czf $FINAL/res.tgz -C /tmp res 2>/dev/null; cp $OUT/step/decode_step.md $OUT/bench/table.md $FINAL/ 2>/dev/null; true; }
trap save EXIT
B=build-cuda; export LD_LIBRARY_PATH=$PWD/libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
T0=$SECONDS
date -u | tee $OUT/env.txt; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee -a $OUT/env.txt
ok=1
for f in $B/gpu_check $B/gpu_bench_kernels $B/libkvpq.so; do ldd $f | grep -q "not found" && ok=0; done
echo "local binaries usable: $ok"
if [ $ok = 0 ]; then
  echo "building on the device"; t0=$SECONDS
  cmake -S . -B build-dev -DKVPQ_CUDA=ON -DCMAKE_BUILD_TYPE=Release -DKVPQ_TESTS=OFF -DCMAKE_CUDA_ARCHITECTURES=90-real >/dev/null
  cmake --build build-dev -j16 --target kvpq_shared gpu_check gpu_bench_kernels > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
  B=build-dev; echo "built in $((SECONDS-t0)) s"
fi
t0=$SECONDS
timeout 110 python3 bench/gpu_bench.py --bin $B/gpu_bench_kernels --out $OUT/bench --attend-only > $OUT/bench.log 2>&1; echo "gpu_bench exit $? in $((SECONDS-t0)) s"; save
t0=$SECONDS
timeout 110 python3 bench/gpu_decode_step.py --lib $B/libkvpq.so --out $OUT/step > $OUT/step.log 2>&1; echo "decode_step exit $? in $((SECONDS-t0)) s"; save
t0=$SECONDS
timeout 60 python3 bench/gpu_decode_step.py --lib $B/libkvpq.so --out $OUT/step2 > $OUT/step2.log 2>&1; echo "decode_step (again) exit $? in $((SECONDS-t0)) s"; save
t0=$SECONDS
timeout 40 ncu --clock-control none -k regex:attend_tc_kernel -c 1 --section SpeedOfLight --section LaunchStats --section Occupancy --section SchedulerStats --section WarpStateStats $B/gpu_bench_kernels attend 1 4096 > $OUT/ncu_b1_4k.txt 2>&1; echo "ncu exit $? in $((SECONDS-t0)) s"; save
grep -A12 "Attention kernel variants" $OUT/bench/table.md | tail -8
grep -A10 "^| B | context | SDPA fp16" $OUT/bench/table.md | head -8
grep -A9 "^| B | context | SDPA eager" $OUT/step/decode_step.md
grep -A9 "^| B | context | SDPA eager" $OUT/step2/decode_step.md
tail -5 $OUT/step.log | cut -c1-300
grep -E "Duration|Registers Per|Achieved Occupancy|No Eligible|Issued Warp" $OUT/ncu_b1_4k.txt | head
left=$((585 - (SECONDS - T0)))
echo "checks with $left s left"
t0=$SECONDS
KVPQ_GPU_PARALLEL=1 KVPQ_NO_BENCH=1 timeout $left tests/gpu/run_gpu_tests.sh $B $OUT/checks > $OUT/checks.out 2>&1; echo "run_gpu_tests exit $? in $((SECONDS-t0)) s"
grep -E "FAIL|passed|clean|skipped|window .* > max_seq|page clamp" $OUT/checks.out | head -20
grep -E "attend D=128 heads 32/8 B=1 maxL=32768" $OUT/checks.out | head -4
