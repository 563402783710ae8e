#!/bin/bash
# Device run: the Python CUDA tests of KVPQCache / CudaCache on the carried CUDA build of libkvpq.
# Run from the repository root: bash .dev-gpu/py_cuda.sh [pytest -k expression]
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
L=$PWD/.dev-gpu/py
for f in $L/*.xz; do
  [ -e "${f%.xz}" ] || python3 -c "import lzma, sys; open(sys.argv[2], 'wb').write(lzma.open(sys.argv[1]).read())" "$f" "${f%.xz}"
done
ln -sf libkvpq.so.0 $L/libkvpq.so; ln -sf libkvpq_model.so.0 $L/libkvpq_model.so
export PYTHONPATH=/tmp/site:$PWD/python:$PWD/bench LD_LIBRARY_PATH=$L KVPQ_LIB=$L/libkvpq_model.so PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
python3 -c "import kvpq, torch, transformers; print(kvpq.cuda_available(), torch.__version__, transformers.__version__)" | tee -a $OUT/env.txt
python3 -m pytest tests/python/test_transformers.py -q -s -k "${1:-cuda}" 2>&1 | tee $OUT/pytest.log
