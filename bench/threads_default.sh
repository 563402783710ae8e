#!/bin/bash
# threads_default.sh — the CLI's default threading beside --threads 1 and 2 and the old default
# (libgomp's spinning wait, OpenBLAS's own thread pool: KVPQ_NO_ENV_FIXUP=1), on this machine as it
# is (loaded or quiet). Decode: `generate --cache fp16 -n 30`; prefill: `ppl --ctx 512 --chunks 2`.
# Usage: bench/threads_default.sh [KVPQ_BIN] [MODEL] [TEXT]   (repeats: REPS=3)
set -u
here=$(cd "$(dirname "$0")/.." && pwd)
bin=${1:-$here/build/kvpq}
model=${2:-$here/models/SmolLM2-135M-Instruct.Q4_1.gguf}
text=${3:-$here/data/text/persuasion.txt}
reps=${REPS:-3}
run() { # name env... -- args...
    local name=$1; shift
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    for r in $(seq "$reps"); do
        dec=$(env "${envs[@]}" "$bin" generate --model "$model" --cache fp16 -n 30 --temp 0 \
              --prompt "Once upon a time" "$@" 2>&1 >/dev/null | sed -n 's/.*one-token evals in .* s (\([0-9.]*\) tok\/s).*/\1/p')
        pre=$(env "${envs[@]}" "$bin" ppl --model "$model" --text "$text" --ctx 512 --chunks 2 --cache fp16 "$@" \
              2>/dev/null | sed -n 's/.* \([0-9.]*\) tok\/s$/\1/p')
        printf '%-28s rep %d   decode %6s tok/s   prefill+score %6s tok/s\n' "$name" "$r" "$dec" "$pre"
    done
}
echo "# $(date -u +%FT%TZ) $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
run "default (new)" X=1 --
run "--threads 1" X=1 -- --threads 1
run "--threads 2" X=1 -- --threads 2
run "old default (spin, BLAS pool)" KVPQ_NO_ENV_FIXUP=1 --
run "old default --threads 1" KVPQ_NO_ENV_FIXUP=1 -- --threads 1
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
