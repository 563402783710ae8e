#!/usr/bin/env bash
# run_target.sh — one target of the fuzz campaign (issue 14: >= 10M executions per target, 0 crashes),
# run outside CI on a many-core machine, then the corpus minimized for committing.
# usage: tests/fuzz/campaign/run_target.sh BUILD_FUZZ_DIR OUT_DIR TARGET [RUNS=10000000] [JOBS=nproc] [MAX_SECONDS=0]
#   BUILD_FUZZ_DIR holds the fuzz_* binaries (scripts/fuzz.sh builds them into build-fuzz/).
#   libFuzzer's fork mode: JOBS processes fuzz at once over one shared corpus; the parent stops after
#   RUNS executions in all (or MAX_SECONDS; 0 = no limit) and keeps going past crashes, OOMs and
#   timeouts (-ignore_crashes/-ignore_ooms/-ignore_timeouts) so that one run finds them all.
#   Memory limits are libFuzzer's defaults made explicit (-rss_limit_mb=2048 -malloc_limit_mb=2048):
#   one allocation over 2 GB from a hostile input is an unchecked size and counts as a failure.
#   Seeds: tests/fuzz/corpus/<name>/ (or tests/fuzz/corpus_<name>/) and tests/fuzz/regressions/<name>/.
#   A second call with the same OUT_DIR continues from the grown corpus (executions add up in the
#   summaries). OUT_DIR/<name>/: corpus/ (grown), merged/ (minimized with -merge=1 from nothing:
#   copy it over the committed corpus), crashes/ (artifacts), fuzz.log, merge.log, and a line appended
#   to summary.txt:
#   target start_utc executions wall_seconds exec_per_s oom timeout crash artifacts merged_inputs merged_bytes
set -uo pipefail
root=$(cd "$(dirname "$0")/../../.." && pwd)
build=$(cd "$1" && pwd); out=$2; t=$3; runs=${4:-10000000}; jobs=${5:-$(nproc)}; max_s=${6:-0}
name=${t#fuzz_}
d=$out/$name
mkdir -p "$d/corpus" "$d/crashes"
d=$(cd "$d" && pwd)
seeds=()
for s in "$root/tests/fuzz/corpus/$name" "$root/tests/fuzz/corpus_$name" "$root/tests/fuzz/regressions/$name"; do
  [ -d "$s" ] && cp -n "$s"/* "$d/corpus/" 2>/dev/null && seeds+=("$s")
done
dict=(); [ -f "$root/tests/fuzz/$t.dict" ] && dict=(-dict="$root/tests/fuzz/$t.dict")
max_len=4096; [ "$t" = fuzz_cache_file ] && max_len=65536 # as scripts/fuzz.sh
start=$(date -u '+%Y-%m-%dT%H:%M:%S')
t0=$(date +%s.%N)
(cd "$d" && "$build/$t" -fork="$jobs" -ignore_crashes=1 -ignore_ooms=1 -ignore_timeouts=1 -runs="$runs" \
   -max_total_time="$max_s" -max_len="$max_len" -rss_limit_mb=2048 -malloc_limit_mb=2048 \
   -artifact_prefix="$d/crashes/" "${dict[@]}" "$d/corpus" >>"$d/fuzz.log" 2>&1)
t1=$(date +%s.%N)
last=$(grep -E '^#[0-9]+: cov:' "$d/fuzz.log" | tail -1)
execs=$(echo "$last" | sed -E 's/^#([0-9]+):.*/\1/')
read -r oom tmo crash < <(echo "$last" | sed -E 's#.*oom/timeout/crash: ([0-9]+)/([0-9]+)/([0-9]+).*#\1 \2 \3#')
arts=$(ls "$d/crashes" | wc -l)
# Minimize: the committed seeds first, then what the campaign added; only inputs adding coverage stay.
rm -rf "$d/merged"; mkdir -p "$d/merged"
"$build/$t" -merge=1 -max_len="$max_len" -rss_limit_mb=2048 -malloc_limit_mb=2048 "$d/merged" "${seeds[@]}" \
  "$d/corpus" >"$d/merge.log" 2>&1
nm=$(ls "$d/merged" | wc -l); nb=$(du -sb "$d/merged" | cut -f1)
wall=$(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.0f", b - a}')
rate=$(awk -v e="${execs:-0}" -v w="$wall" 'BEGIN {printf "%.0f", e / (w > 0 ? w : 1)}')
echo "$t $start ${execs:-0} $wall $rate ${oom:-?} ${tmo:-?} ${crash:-?} $arts $nm $nb" | tee -a "$out/summary.txt"
