#!/bin/bash
R=$PWD; W=$R/.gpuwt-lead; export OMP_WAIT_POLICY=PASSIVE
mkdir -p /tmp/dep && tar -C /tmp/dep -xJf $W/dep.tar.xz && export LD_LIBRARY_PATH=/tmp/dep/lib:$W/lib
nvidia-smi -L; grep -o -m1 'avx512f' /proc/cpuinfo
( cd $W && KVPQ_SIMD=avx512 timeout 100 ./test_ggml_types > $OUT/avx512_ggml.log 2>&1; echo "test_ggml_types avx512 rc=$?" >> $OUT/avx512_ggml.log
  KVPQ_SIMD=avx512 timeout 100 ./test_cpu_kernels > $OUT/avx512_cpu.log 2>&1; echo "test_cpu_kernels avx512 rc=$?" >> $OUT/avx512_cpu.log ) &
A=$!
( timeout 200 $W/gpu_check > $OUT/gpu_check.log 2>&1; echo "gpu_check rc=$?" >> $OUT/gpu_check.log ) &
G=$!
python3 -m pip install -q --no-index --no-deps --target /tmp/site $W/whl/*.whl > /tmp/pip.log 2>&1
PYTHONPATH=$R/python:/tmp/site KVPQ_LIB=$W/lib/libkvpq.so KVPQ_SOURCE_DIR=$R OMP_NUM_THREADS=2 PYTHONUNBUFFERED=1 \
  timeout 200 python3 -m pytest -p no:cacheprovider -v -rs tests/python/test_transformers.py > $OUT/pytest.log 2>&1; echo "pytest rc $?" >> $OUT/pytest.log
wait $A; wait $G
tail -5 $OUT/avx512_ggml.log $OUT/avx512_cpu.log $OUT/gpu_check.log; tail -25 $OUT/pytest.log
