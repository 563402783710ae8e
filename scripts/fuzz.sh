#!/usr/bin/env bash
# Build the libFuzzer targets (tests/fuzz/fuzz_*.c, clang, ASan+UBSan) and run each for a while.
# usage: scripts/fuzz.sh [SECONDS_PER_TARGET (default 60)] [TARGET ...]
# Seeds: tests/fuzz/corpus/<name>/ or tests/fuzz/corpus_<name>/ (fuzz_<name>.c), and the inputs of past crashes,
# tests/fuzz/regressions/<name>/ (each run replays them first), copied into build-fuzz/corpus/ so the committed
# seeds stay small; a dictionary tests/fuzz/fuzz_<name>.dict is used when present. Crashes are
# written to build-fuzz/crashes/ and make the script fail.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
secs=${1:-60}
shift || true
CC=clang CXX=clang++ cmake -S . -B build-fuzz -DKVPQ_FUZZ=ON -DKVPQ_TESTS=OFF -DKVPQ_CUDA=OFF >/dev/null
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  for f in tests/fuzz/fuzz_*.c; do [ -e "$f" ] && targets+=("$(basename "$f" .c)"); done
fi
cmake --build build-fuzz -j2 --target "${targets[@]}"
mkdir -p build-fuzz/crashes
for t in "${targets[@]}"; do
  name=${t#fuzz_}
  corpus=build-fuzz/corpus/$name
  mkdir -p "$corpus"
  for seeds in "tests/fuzz/corpus/$name" "tests/fuzz/corpus_$name" "tests/fuzz/regressions/$name"; do
    [ -d "$seeds" ] && cp -n "$seeds"/* "$corpus"/ 2>/dev/null || true
  done
  dict=(); [ -f "tests/fuzz/$t.dict" ] && dict=(-dict="tests/fuzz/$t.dict")
  # Inputs may grow to 4 KiB, except saved caches: their seeds (a 60-position cache of each kind) are
  # up to 33 KiB, and a seed cut at 4 KiB only reaches the size check.
  max_len=4096; [ "$t" = fuzz_cache_file ] && max_len=36864
  echo "== $t for ${secs}s"
  "build-fuzz/$t" -max_total_time="$secs" -max_len="$max_len" -print_final_stats=1 \
    -artifact_prefix="build-fuzz/crashes/$t-" "${dict[@]}" "$corpus" 2>&1 | grep -E "^(Done|stat::|==|SUMMARY)" || true
  if ls "build-fuzz/crashes/$t-"* >/dev/null 2>&1; then echo "fuzz.sh: $t found crashes (build-fuzz/crashes)" >&2; exit 1; fi
done
