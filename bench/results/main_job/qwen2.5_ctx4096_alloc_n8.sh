#!/bin/bash
cd "$(dirname "$0")/../../.."  # the repository root (the run was made in the main worktree)
export OMP_WAIT_POLICY=PASSIVE
M=models/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf
O=out/s13
/usr/bin/time -v build/kvpq calibrate --model $M --text data/text/emma.txt --tokens 4096 --ctx 4096 --bits 2.5 -o $O/qwen_b2.5_n8.safetensors --bits-also "2.1 $O/qwen_b2.1_n8.safetensors" --bits-also "3.0 $O/qwen_b3.0_n8.safetensors" --bits-also "2.0 $O/qwen_b2.0_n8.safetensors" --threads 2 > $O/qwen_n8_calibrate.log 2>&1
echo "EXIT $?" >> $O/qwen_n8_calibrate.log
/usr/bin/time -v build/kvpq ppl --model $M --text data/text/persuasion.txt --ctx 4096 --chunks 1 --threads 2 --json --cache vq:$O/qwen_b2.0_n8.safetensors,vq:$O/qwen_b2.1_n8.safetensors,vq:$O/qwen_b2.5_n8.safetensors,vq:$O/qwen_b3.0_n8.safetensors --kl-base fp16 > $O/qwen_n8_ppl.json 2> $O/qwen_n8_ppl.log
echo "EXIT $?" >> $O/qwen_n8_ppl.log
