#!/usr/bin/env bash
# Build the libFuzzer targets (tests/fuzz/fuzz_*.c, clang, ASan+UBSan) and run each for a while.
# usage: scripts/fuzz.sh [--merge] [SECONDS_PER_TARGET (default 60)] [TARGET ...]
# Seeds: tests/fuzz/corpus/<name>/ or tests/fuzz/corpus_<name>/ (fuzz_<name>.c), and the inputs of past crashes,
# tests/fuzz/regressions/<name>/ (each run replays them first), copied into build-fuzz/corpus/<name>/. That
# folder is kept between runs, so a run resumes from what the earlier ones found. --merge then adds to the
# committed corpus the inputs that reach new coverage (libFuzzer -merge=1), so it grows from run to run.
# A dictionary tests/fuzz/fuzz_<name>.dict is used when present. Crashes are written to build-fuzz/crashes/
# and make the script fail. Each run appends "date target executions seconds" to build-fuzz/runs.tsv.
# KVPQ_FUZZ_RUNS=N stops a target after N executions (SECONDS stays the limit).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
merge=0
if [ "${1:-}" = --merge ]; then merge=1; shift; fi
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
  committed=tests/fuzz/corpus/$name
  [ -d "tests/fuzz/corpus_$name" ] && committed=tests/fuzz/corpus_$name
  for seeds in "$committed" "tests/fuzz/regressions/$name"; do
    [ -d "$seeds" ] && cp -n "$seeds"/* "$corpus"/ 2>/dev/null || true
  done
  dict=(); [ -f "tests/fuzz/$t.dict" ] && dict=(-dict="tests/fuzz/$t.dict")
  runs_opt=(); [ -n "${KVPQ_FUZZ_RUNS:-}" ] && runs_opt=(-runs="$KVPQ_FUZZ_RUNS")
  # Inputs may grow to 4 KiB, except saved caches: their seeds (a 44-position cache of every kind and
  # variant, the fp32 ones 48 KiB) would be cut, and a seed cut at 4 KiB only reaches the size check.
  max_len=4096; [ "$t" = fuzz_cache_file ] && max_len=65536
  echo "== $t for ${secs}s"
  log=build-fuzz/$t.log
  start=$(date +%s)
  "build-fuzz/$t" -max_total_time="$secs" -max_len="$max_len" -print_final_stats=1 \
    -artifact_prefix="build-fuzz/crashes/$t-" "${dict[@]}" "${runs_opt[@]}" "$corpus" >"$log" 2>&1 || true
  grep -E "^(Done|stat::number_of_executed_units|==|SUMMARY)" "$log" || true
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  printf '%s\t%s\t%s\t%s\n' "$(date -u +%FT%TZ)" "$t" "${runs:-0}" "$(( $(date +%s) - start ))" >> build-fuzz/runs.tsv
  if ls "build-fuzz/crashes/$t-"* >/dev/null 2>&1; then echo "fuzz.sh: $t found crashes (build-fuzz/crashes)" >&2; exit 1; fi
  if [ "$merge" = 1 ]; then
    mkdir -p "$committed"
    before=$(ls "$committed" | wc -l)
    "build-fuzz/$t" -merge=1 -max_len="$max_len" "$committed" "$corpus" >"build-fuzz/$t.merge.log" 2>&1
    echo "fuzz.sh: $committed: $before -> $(ls "$committed" | wc -l) inputs"
  fi
done
