#!/bin/bash
# Device run: gpu_cache_backend_check and gpu_check (full) of the carried binaries (xz).
set -u
cd "$(dirname "$0")/bins2"
for f in *.xz; do [ -e "${f%.xz}" ] || python3 -c "import lzma, sys; open(sys.argv[2], 'wb').write(lzma.open(sys.argv[1]).read())" "$f" "${f%.xz}"; done
chmod +x gpu_check gpu_cache_backend_check
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
t=$SECONDS; timeout 240 ./gpu_cache_backend_check > $OUT/cache_backend_check.log 2>&1; echo "cache_backend_check: exit $? in $((SECONDS - t)) s" | tee -a $OUT/summary.txt
t=$SECONDS; timeout 330 ./gpu_check > $OUT/gpu_check.log 2>&1; echo "gpu_check: exit $? in $((SECONDS - t)) s" | tee -a $OUT/summary.txt
tail -n 3 $OUT/cache_backend_check.log $OUT/gpu_check.log
