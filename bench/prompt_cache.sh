#!/bin/bash
# prompt_cache.sh — `kvpq generate --prompt-cache` on a long prompt: for each cache SPEC, run 1
# computes the prompt and saves it, run 2 loads it; prints the file size (beside the first SPEC's,
# fp16 by default) and time to first token of both runs (the recompute is the baseline).
# Usage: bench/prompt_cache.sh CODEBOOK [CHARS]   (CHARS of data/text/persuasion.txt, default 16000:
# ~4100 tokens on SmolLM2)
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
bin=${KVPQ_BIN:-$here/build/kvpq}
model=${MODEL:-$here/models/SmolLM2-135M-Instruct.Q4_1.gguf}
cb=$1
chars=${2:-16000}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prompt=$(head -c "$chars" "$here/data/text/persuasion.txt" | iconv -f utf-8 -t utf-8 -c)
printf '%-34s %8s %12s %8s %14s %14s %8s\n' cache tokens "file bytes" "vs fp16" "recompute s" "load+1st s" speedup
base=""
for spec in fp16 "vq:$cb"; do
    f="$tmp/p.kvc"; rm -f "$f"
    r1=$("$bin" generate --model "$model" --cache "$spec" --prompt "$prompt" -n 1 --temp 0 --quiet \
         --prompt-cache "$f" 2>&1 >/dev/null)
    r2=$("$bin" generate --model "$model" --cache "$spec" --prompt "$prompt" -n 1 --temp 0 --quiet \
         --prompt-cache "$f" 2>&1 >/dev/null)
    ttf() { sed -n 's/.*first token after \([0-9.]*\) s.*/\1/p'; }
    t1=$(echo "$r1" | ttf); t2=$(echo "$r2" | ttf)
    n=$(echo "$r1" | sed -n 's/.*prompt \([0-9]*\) tokens in.*/\1/p')
    reused=$(echo "$r2" | sed -n 's/.*prompt cache load [0-9.]* s for \([0-9]*\) tokens.*/\1/p')
    bytes=$(stat -c %s "$f")
    [ -z "$base" ] && base=$bytes
    printf '%-34s %8s %12s %7.3fx %14s %14s %7.1fx   (run 2 reused %s tokens)\n' "$spec" "$n" "$bytes" \
        "$(echo "$bytes / $base" | bc -l)" "$t1" "$t2" "$(echo "$t1 / $t2" | bc -l)" "$reused"
done
