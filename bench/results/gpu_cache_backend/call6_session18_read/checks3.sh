#!/bin/bash
# Device run: gpu_cache_backend_check (kvpq_cache's CUDA backend: read and truncate now through
# kvpq_cuda_cache_read) of the carried binary (xz); needs .dev-gpu/libs (libcjson) on LD_LIBRARY_PATH.
set -u
cd "$(dirname "$0")/bins2"
for f in *.xz; do [ -e "${f%.xz}" ] || python3 -c "import lzma, sys; open(sys.argv[2], 'wb').write(lzma.open(sys.argv[1]).read())" "$f" "${f%.xz}"; done
chmod +x gpu_cache_backend_check
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
t=$SECONDS; timeout 200 ./gpu_cache_backend_check > $OUT/cache_backend_check.log 2>&1; echo "cache_backend_check: exit $? in $((SECONDS - t)) s" | tee -a $OUT/summary.txt
t=$SECONDS; KVPQ_QUICK=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 99 ./gpu_cache_backend_check > $OUT/memcheck_cache_backend.log 2>&1; echo "memcheck cache_backend_check: exit $? in $((SECONDS - t)) s" | tee -a $OUT/summary.txt
grep -v "^  " $OUT/cache_backend_check.log | tail -n 6; tail -n 3 $OUT/memcheck_cache_backend.log
