#!/bin/bash
# device call 1 (GPU engineer, session 13), main's tree (40e91eb) as is: checks (tests/gpu/run_gpu_tests.sh with
# KVPQ_GPU_PARALLEL=1 KVPQ_NO_BENCH=1: gpu_check, compute-sanitizer memcheck and racecheck at the same time),
# then bench/gpu_bench.py (ours vs SDPA in one process) and bench/gpu_decode_step.py (32-layer step), on the
# full build of main made on the development machine (nvcc 13.0, -DKVPQ_CUDA=ON -DCMAKE_BUILD_TYPE=Release
# -DKVPQ_TESTS=OFF -DKVPQ_WERROR=ON -DCMAKE_CUDA_ARCHITECTURES=90-real), carried as .dev-gpu/full.tgz with
# libcjson / libgomp beside it and cffi / pycparser wheels for the Python binding.
set -u
R=$(pwd); D=$R/.dev-gpu; O=$(mktemp -d); S=$(mktemp -d)
tar xzf $D/full.tgz -C $D
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $S $D/whl/*.whl && export PYTHONPATH=$S
export LD_LIBRARY_PATH=$D/libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} KVPQ_INCLUDE=$R/include
date -u | tee $O/env.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee -a $O/env.txt
compute-sanitizer --version | tail -1 | tee -a $O/env.txt
python3 -c "import torch; print('torch', torch.__version__)" | tee -a $O/env.txt
(git -C $R log -1 --format='tree %h' 2>/dev/null || echo "tree: no git") | tee -a $O/env.txt
t0=$SECONDS
KVPQ_GPU_PARALLEL=1 KVPQ_NO_BENCH=1 timeout 430 tests/gpu/run_gpu_tests.sh $D/full $O/checks > $O/checks.out 2>&1; echo "run_gpu_tests exit $? in $((SECONDS-t0)) s" | tee -a $O/env.txt
grep -E "FAIL|passed|clean|skipped|seed" $O/checks.out | head -12
cat $O/checks/*.status 2>/dev/null
export PYTHONUNBUFFERED=1
t0=$SECONDS
timeout 100 python3 bench/gpu_bench.py --bin $D/full/gpu_bench_kernels --out $O/bench > $O/bench.log 2>&1; echo "gpu_bench exit $? in $((SECONDS-t0)) s" | tee -a $O/env.txt
t0=$SECONDS
timeout 50 python3 bench/gpu_decode_step.py --lib $D/full/libkvpq.so --out $O/step > $O/step.log 2>&1; echo "decode_step exit $? in $((SECONDS-t0)) s" | tee -a $O/env.txt
date -u | tee -a $O/env.txt
grep -A8 "^| B | context | SDPA fp16 | SDPA GB" $O/bench/table.md | head -8
grep -A8 "^| B | context | SDPA eager" $O/step/decode_step.md
tail -3 $O/step.log | cut -c1-300
cd $O && tar czf $OUT/raw.tgz . ; cp $O/checks.out $O/env.txt $O/bench.log $O/step.log $OUT/ 2>/dev/null
cp $O/bench/table.md $OUT/bench_table.md 2>/dev/null; cp $O/step/decode_step.md $OUT/decode_step.md 2>/dev/null
