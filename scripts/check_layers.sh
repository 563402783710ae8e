#!/usr/bin/env bash
# check_layers.sh — fails when an #include crosses kvpq's layers the wrong way.
#
# Layers, lowest first; a file may include headers of its own layer or a lower one only:
#   0 core  (src/core)           status, errors, fp16, ggml block layouts
#   1 cpu   (src/cpu)            SIMD kernels and their one table
#   2 pq    (src/pq)             codebooks, k-means, encode/decode
#   3 cache (src/cache, src/cuda) KV caches and their CUDA backend
#   4 model (src/model)          GGUF, tokenizer, forward pass
#   5 tools, python              the CLI and bindings: public headers (include/) and their own only
# A layer's private headers (PRIVATE below: the cache kinds' ops table and row engine, the codebook
# internals) are for their own directory only: the model uses the cache's public API.
# bench/ may include public headers and the internal headers listed in BENCH_INTERNAL (the kernels
# a benchmark times directly); tests/ may include anything (they test internals).
# A quoted include is resolved as the compiler does here: the including file's directory, then
# src/ (for "layer/name.h"), src/core, include/. Angle-bracket includes are system headers.
#
# Usage: scripts/check_layers.sh [repo root]   (exit 0: clean; 1: violations, one per line)
set -euo pipefail
root=${1:-$(cd "$(dirname "$0")/.." && pwd)}
cd "$root"

BENCH_INTERNAL="model/ggml_types.h model/gguf.h cuda/common.cuh"  # gguf.h: bench_kquant times kernels on a real file's tensors
PRIVATE="src/cache/cache_impl.h src/cache/cache_cpu.h src/pq/codebook_impl.h"

rank() { # directory (relative to the root) -> layer rank, or empty for public/tool/other
    case "$1" in
    src/core*) echo 0 ;;
    src/cpu*) echo 1 ;;
    src/pq*) echo 2 ;;
    src/cache* | src/cuda*) echo 3 ;;
    src/model*) echo 4 ;;
    *) echo "" ;;
    esac
}

resolve() { # including file, quoted name -> path relative to the root ("" if not found)
    local dir name=$2
    dir=$(dirname "$1")
    for cand in "$dir/$name" "src/$name" "src/core/$name" "include/$name"; do
        if [ -f "$cand" ]; then
            realpath --relative-to=. "$cand"
            return
        fi
    done
    echo ""
}

bad=0
report() {
    echo "$1"
    bad=1
}

if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    list=$(git ls-files -co --exclude-standard -- src tools bench python)
else
    list=$(find src tools bench python -type f 2>/dev/null)
fi
files=$(grep -E '\.(c|h|cu|cuh|cpp)$' <<<"$list" || true)
if [ -z "$files" ]; then
    echo "check_layers: no source files under $root" >&2
    exit 2
fi
for f in $files; do
    [ -f "$f" ] || continue
    while IFS= read -r line; do
        name=$(sed -E 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"([^"]+)".*/\1/' <<<"$line")
        target=$(resolve "$f" "$name")
        [ -n "$target" ] || continue # not ours (e.g. llama.h of a peer build): the compiler's business
        src_rank=$(rank "$(dirname "$f")")
        dst_rank=$(rank "$(dirname "$target")")
        for h in $PRIVATE; do
            if [ "$target" = "$h" ] && [ "$(dirname "$f")" != "$(dirname "$h")" ]; then
                case "$f" in
                tests/*) ;;
                *) report "$f: #include \"$name\": private to $(dirname "$h")" ;;
                esac
            fi
        done
        case "$f" in
        src/*)
            if [ -n "$dst_rank" ] && [ -n "$src_rank" ] && [ "$dst_rank" -gt "$src_rank" ]; then
                report "$f: #include \"$name\" ($target): layer $dst_rank above this file's layer $src_rank"
            fi
            ;;
        tools/* | python/*)
            case "$target" in
            include/* | tools/* | python/*) ;;
            *) report "$f: #include \"$name\" ($target): tools and bindings use the public headers only" ;;
            esac
            ;;
        bench/*)
            case "$target" in
            include/* | bench/*) ;;
            *)
                ok=0
                for h in $BENCH_INTERNAL; do [ "$target" = "src/$h" ] && ok=1; done
                [ $ok = 1 ] || report "$f: #include \"$name\" ($target): not public, not in BENCH_INTERNAL"
                ;;
            esac
            ;;
        esac
    done < <(grep -E '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' "$f" || true)
done

if [ $bad = 0 ]; then
    echo "check_layers: every include points down the layers (core <- cpu <- pq <- cache <- model <- tools)"
fi
exit $bad
