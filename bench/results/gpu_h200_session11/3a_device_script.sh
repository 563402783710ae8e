#!/bin/bash
# device call 3a (device helper, session 11): where the b1@4k attention time goes, from globaltimer and
# clock64 stamps per CTA in main's tensor-core kernel (KVPQ_ATTEND_DEV_SHAPES build with
# 3_attend_timeline_diag.diff; diagnostic only). The stamps are those of the last launch of the
# default variant's CUDA graph (20 launches per replay, PDL).
set -u
cd "$(dirname "$0")/../../.."
export LD_LIBRARY_PATH=$PWD/../libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
date -u; nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader
for s in "1 4096" "1 4096" "1 32768" "8 4096" "8 32768"; do timeout 60 ../devbin/tl/gpu_bench_kernels attend $s 2>&1 | grep -E '"timeline"|"op": "attend"|rror' | sed 's/"variant_us".*"tc": \([0-9.]*\).*/tc \1/' | tee -a $OUT/timeline.txt; done
