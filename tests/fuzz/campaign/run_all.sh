#!/usr/bin/env bash
# run_all.sh — the whole campaign (issue 14): every tests/fuzz/fuzz_*.c target to RUNS executions
# (default 10M) with 0 crashes, one target at a time over all cores, then the minimized corpora copied
# over the committed ones. Outside CI; on 16 cores it took about 15 min (docs/robustness.md).
# usage: tests/fuzz/campaign/run_all.sh [OUT_DIR=build-fuzz/campaign] [RUNS=10000000] [JOBS=nproc]
#   Builds the targets first (as scripts/fuzz.sh does). fuzz_tokenize needs the
#   real vocabulary: models/SmolLM2-135M-Instruct.Q4_1.gguf or KVPQ_MODEL (scripts/fetch_model.sh).
#   Exit status 1 when any target had an OOM, timeout or crash (artifacts in OUT_DIR/<name>/crashes/).
set -euo pipefail
root=$(cd "$(dirname "$0")/../../.." && pwd)
cd "$root"
out=${1:-build-fuzz/campaign}; runs=${2:-10000000}; jobs=${3:-$(nproc)}
CC=clang CXX=clang++ cmake -S . -B build-fuzz -DKVPQ_FUZZ=ON -DKVPQ_TESTS=OFF -DKVPQ_CUDA=OFF >/dev/null
cmake --build build-fuzz -j"$jobs" >/dev/null
mkdir -p "$out"
rc=0
for src in tests/fuzz/fuzz_*.c; do
  t=$(basename "$src" .c); name=${t#fuzz_}
  line=$(tests/fuzz/campaign/run_target.sh build-fuzz "$out" "$t" "$runs" "$jobs" 0 | tail -1)
  echo "$line"
  read -r _ _ execs _ _ oom tmo crash arts _ <<<"$line"
  if [ "$oom" != 0 ] || [ "$tmo" != 0 ] || [ "$crash" != 0 ] || [ "$arts" != 0 ]; then rc=1; continue; fi
  dst=tests/fuzz/corpus/$name; [ -d "tests/fuzz/corpus_$name" ] && dst=tests/fuzz/corpus_$name
  # hash-named inputs are replaced by the minimized set; named seeds (make_*seeds.py) stay
  find "$dst" -maxdepth 1 -type f -regextype posix-extended -regex '.*/[0-9a-f]{40}' -delete
  cp -n "$out/$name/merged/"* "$dst/"
done
exit $rc
