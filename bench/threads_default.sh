#!/bin/bash
# threads_default.sh — the CLI's default threading beside --threads 1 and --threads 2, in one run, on
# this machine as it is (loaded or quiet), as a table (issue 15 item 3: the default within 20% of the
# best --threads). Decode: `generate --cache fp16 -n 30 --temp 0` (the one-token evals' tok/s);
# prefill: `ppl --ctx 512 --chunks 1 --cache fp16` (tok/s of the 512-token chunk). The settings run
# in rounds (each round every setting once, the order rotated), so a load change hits all alike;
# the table shows the median of the rounds and each round's value. ~1 minute on a quiet 2-core
# machine (REPS=3). OLD=1 adds the old default (libgomp's spinning wait and OpenBLAS's own thread
# pool: KVPQ_NO_ENV_FIXUP=1), which collapses on a loaded machine.
# Usage: bench/threads_default.sh [KVPQ_BIN] [MODEL] [TEXT]   (env: REPS=3, OLD=0)
set -u
here=$(cd "$(dirname "$0")/.." && pwd)
bin=${1:-$here/build/kvpq}
model=${2:-$here/models/SmolLM2-135M-Instruct.Q4_1.gguf}
text=${3:-$here/data/text/persuasion.txt}
reps=${REPS:-3}
[ -x "$bin" ] || { echo "threads_default: no kvpq at $bin (build first)" >&2; exit 2; }
[ -e "$model" ] || { echo "threads_default: no model at $model (scripts/fetch_model.sh)" >&2; exit 2; }

names=("default" "--threads 1" "--threads 2")
envs=("X=1" "X=1" "X=1")
args=("" "--threads 1" "--threads 2")
if [ "${OLD:-0}" = 1 ]; then
    names+=("old default (spin, BLAS pool)"); envs+=("KVPQ_NO_ENV_FIXUP=1"); args+=("")
fi
n=${#names[@]}
out=$(mktemp)
trap 'rm -f "$out"' EXIT

echo "# $(date -u +%FT%TZ) $(nproc) cores ($(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1)), load $(cut -d' ' -f1-3 /proc/loadavg), $reps rounds"
for r in $(seq "$reps"); do
    for k in $(seq 0 $((n - 1))); do
        i=$(((k + r - 1) % n)) # rotate the order per round
        # shellcheck disable=SC2086  # args[i] is meant to split into words
        dec=$(env "${envs[$i]}" "$bin" generate --model "$model" --cache fp16 -n 30 --temp 0 \
              --prompt "Once upon a time" ${args[$i]} 2>&1 >/dev/null |
              sed -n 's/.*one-token evals in .* s (\([0-9.]*\) tok\/s).*/\1/p')
        # shellcheck disable=SC2086
        pre=$(env "${envs[$i]}" "$bin" ppl --model "$model" --text "$text" --ctx 512 --chunks 1 --cache fp16 \
              --quiet ${args[$i]} 2>/dev/null | sed -n 's/.* \([0-9.]*\) tok\/s$/\1/p')
        echo "$i ${dec:-nan} ${pre:-nan}" >>"$out"
        echo "#   round $r: ${names[$i]}: decode ${dec:-?} tok/s, prefill ${pre:-?} tok/s" >&2
    done
done
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "| setting | decode tok/s (median) | prefill tok/s (median) | decode / best | prefill / best | decode per round | prefill per round |"
echo "| --- | ---: | ---: | ---: | ---: | --- | --- |"
for i in $(seq 0 $((n - 1))); do
    printf '%s\t%s\n' "$i" "${names[$i]}"
done | awk -F'\t' -v data="$out" '
    function median(a, m,   t, j, k, x) { # a[1..m] numbers
        for (j = 1; j <= m; j++) t[j] = a[j]
        for (j = 2; j <= m; j++) { x = t[j]; for (k = j - 1; k >= 1 && t[k] > x; k--) t[k + 1] = t[k]; t[k + 1] = x }
        return m % 2 ? t[(m + 1) / 2] : (t[m / 2] + t[m / 2 + 1]) / 2
    }
    { name[$1] = $2; order[++ns] = $1 }
    END {
        while ((getline line < data) > 0) {
            split(line, f, " "); i = f[1]
            nd[i]++; d[i, nd[i]] = f[2]; p[i, nd[i]] = f[3]
            ld[i] = ld[i] (ld[i] == "" ? "" : ", ") f[2]; lp[i] = lp[i] (lp[i] == "" ? "" : ", ") f[3]
        }
        for (s = 1; s <= ns; s++) {
            i = order[s]; delete a; delete b
            for (j = 1; j <= nd[i]; j++) { a[j] = d[i, j]; b[j] = p[i, j] }
            md[i] = median(a, nd[i]); mp[i] = median(b, nd[i])
            if (i <= 2) { if (md[i] > bd) bd = md[i]; if (mp[i] > bp) bp = mp[i] } # best of the 3 current settings
        }
        for (s = 1; s <= ns; s++) {
            i = order[s]
            rd = (bd > 0) ? md[i] / bd : 0; rp = (bp > 0) ? mp[i] / bp : 0
            printf("| %s | %.1f | %.1f | %.2f | %.2f | %s | %s |\n", name[i], md[i], mp[i], rd, rp, ld[i], lp[i])
        }
    }'
