#!/bin/bash
# Device call 2 of issue 36 item 1: the CLI with the cache on the CPU and on the GPU (the model's
# layers on the CPU either way). bins/kvpq built as tests_device.sh says; libs/ the shared libraries
# the device lacks (OpenBLAS, gfortran, quadmath, PCRE2, cJSON); data/ SmolLM2-135M-Instruct Q4_1 cut
# to its first 2 blocks (bench/gguf_slice_layers.py: the whole model exceeds what a call carries), a
# codebook calibrated on it on the development machine (kvpq calibrate --tokens 8192 --ctx 1024:
# d4b8 keys and values, norm-explicit) and persuasion.txt. Run as: bash .dev-gpu/cli_device.sh $OUT
set -u
source "$(dirname "$0")/common.sh" "$1"
T=data/persuasion.txt; M=data/smol2.gguf; CB=data/smol2_cb.safetensors
for tag in cpu cuda; do
  spec=vq:$CB; [ $tag = cuda ] && spec=vq:$CB:cuda
  step ppl_$tag bins/kvpq ppl --model $M --text $T --ctx 512 --chunks 4 --cache $spec --threads 16 --quiet
  # window 16, so that most of the 102 positions are attended from codes
  step gen_$tag bins/kvpq generate --model $M --prompt "It was a truth universally acknowledged" -n 96 --temp 0 \
       --cache $spec:w16 --print-ids --threads 16
done
# KL(cpu cache || gpu cache) per scored token and top-1 agreement, the same chunks
step ppl_kl bins/kvpq ppl --model $M --text $T --ctx 512 --chunks 4 --cache "vq:$CB:cuda" --kl-base "vq:$CB" \
     --threads 16 --quiet
if cmp -s <(grep -v "^kvpq generate" $O/gen_cpu.log) <(grep -v "^kvpq generate" $O/gen_cuda.log); then
  echo "generate: the same token ids with the cache on the CPU and on the GPU" | tee -a $O/summary.txt
else
  echo "generate: token ids differ" | tee -a $O/summary.txt
fi
date -u | tee -a $O/env.txt
tail -n 4 $O/ppl_cpu.log $O/ppl_cuda.log $O/ppl_kl.log
head -n 3 $O/gen_cpu.log $O/gen_cuda.log
cat $O/summary.txt
