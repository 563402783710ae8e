#!/bin/bash
# decode_ab.sh — decode tok/s of several kvpq builds / settings in one run, alternating rounds (each
# round runs every variant once, the order rotated, so a load change on a shared machine hits all
# alike): median of the rounds, each round's value, and each variant's ratio to the first.
# Decode: `kvpq generate --cache fp16 --threads T -n N --temp 0 --prompt "Once upon a time"`, the
# one-token evals' tok/s as generate prints them (it may stop early at the end-of-sequence token;
# the rate is then over fewer evals).
# Usage: bench/decode_ab.sh MODEL "LABEL|ENV|BIN" ...   ENV: space-separated VAR=VALUE ("-" for none)
#   env: REPS=5 THREADS=2 N=64
# Example (issue 34 item 2): bench/decode_ab.sh models/SmolLM2-135M-Instruct.Q4_1.gguf \
#   "main-path f32|KVPQ_ACT=f32|/tmp/base/kvpq" "merged f32|KVPQ_ACT=f32|build/kvpq"
set -u
model=$1
shift
reps=${REPS:-5}
threads=${THREADS:-2}
ntok=${N:-64}
[ -e "$model" ] || { echo "decode_ab: no model at $model" >&2; exit 2; }
labels=() envs=() bins=()
for v in "$@"; do
    IFS='|' read -r l e b <<<"$v"
    [ -x "$b" ] || { echo "decode_ab: $l: no kvpq at $b" >&2; exit 2; }
    labels+=("$l") envs+=("$e") bins+=("$b")
done
n=${#labels[@]}
declare -A vals
echo "# $(date -u +%FT%TZ) $(nproc) cores ($(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1)), load $(cut -d' ' -f1-3 /proc/loadavg), $reps rounds, $threads threads, $(basename "$model")"
for r in $(seq "$reps"); do
    for k in $(seq 0 $((n - 1))); do
        i=$(((k + r - 1) % n))
        e=${envs[$i]}
        [ "$e" = "-" ] && e="X_DECODE_AB=1"
        # shellcheck disable=SC2086  # e is a list of VAR=VALUE words
        t=$(env $e "${bins[$i]}" generate --model "$model" --cache fp16 -n "$ntok" --temp 0 --threads "$threads" \
            --prompt "Once upon a time" 2>&1 >/dev/null | sed -n 's/.*one-token evals in .* s (\([0-9.]*\) tok\/s).*/\1/p')
        vals[$i]="${vals[$i]:-} ${t:-nan}"
    done
done
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
med() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
m0=$(echo "${vals[0]}" | med)
printf "| %-36s | %-34s | %8s | %6s | %s |\n" variant env "tok/s" "ratio" "rounds"
printf "|%s|%s|%s|%s|%s|\n" "---" "---" "---:" "---:" "---"
for i in $(seq 0 $((n - 1))); do
    m=$(echo "${vals[$i]}" | med)
    printf "| %-36s | %-34s | %8.1f | %6.2f | %s |\n" "${labels[$i]}" "${envs[$i]}" "$m" "$(echo "$m / $m0" | bc -l)" "${vals[$i]# }"
done
