#!/usr/bin/env bash
# The main job, end to end on a fresh machine: install dependencies, build, fetch SmolLM2-135M,
# calibrate codebooks on one novel (data/text/emma.txt) for the four VQ presets, measure perplexity,
# KL and top-1 agreement against the fp16 cache on the held-out novel (data/text/persuasion.txt) at
# context 1024 and 4096 for every cache type, print one table, write the figure, and generate a
# paragraph with the 2-bit cache.
# Environment: KVPQ_THREADS (default: all cores), CHUNKS_1K (default 8), CHUNKS_4K (default 4),
# CALIB_TOKENS (default 32768).
# Peer rows (issue 18): PEER_MODELS (default "smollm2-135m"; "all" adds qwen2.5-coder-1.5b and
# gemma3-270m, fetched by scripts/fetch_model.sh) gets the rows of every peer cache (fp16 q8_0 q4_0
# q8_0r q4_0r kivi2 kivi4, KL against the fp16 cache) on the held-out novel into
# $out/peers/<model>_ctx<L>_peers.json: SmolLM2 at ctx 1024 (CHUNKS_1K) and 4096, the others at 4096,
# CHUNKS_PEER_4K chunks (default 1: Qwen2.5-1.5B costs ~210 CPU-seconds per cache and 4096-token
# chunk). PEER_MODELS=none skips them.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
threads=${KVPQ_THREADS:-$(nproc)}
chunks1k=${CHUNKS_1K:-8}
chunks4k=${CHUNKS_4K:-4}
calib_tokens=${CALIB_TOKENS:-32768}
peer_models=${PEER_MODELS:-smollm2-135m}
chunks_peer4k=${CHUNKS_PEER_4K:-1}
[ "$peer_models" = all ] && peer_models="smollm2-135m qwen2.5-coder-1.5b gemma3-270m"
[ "$peer_models" = none ] && peer_models=""
out=out/main_job
./scripts/deps.sh
./scripts/fetch_model.sh smollm2-135m $peer_models
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" --target kvpq_cli
kvpq=build/kvpq
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$out"
"$kvpq" info "$model" > "$out/model_info.txt"
head -n 20 "$out/model_info.txt"

echo "== calibrate on data/text/emma.txt ($calib_tokens tokens)"
# The four presets (norm-explicit keys and values, calibrate's default: a float16 scale per vector
# beside the codes), the 2-bit preset without them (d4b8_plain: codes only, for comparison), then the
# 2-bit preset with 4-bit keys (d2b8's M) in the layers that carry most of its loss
# (docs/vq_quality.md): layers 10-19 and 2-19.
presets="d8b8 d8b12 d4b8 d2b8 d4b8_plain d4b8_k4_L10_19 d4b8_k4_L2_19"
# One forward pass serves every codebook (`--also`): the main command writes d4b8, each --also job
# one more preset.
also=()
for p in $presets; do
  [ "$p" = d4b8 ] && continue
  o="--keys ${p%%_*}"
  # ksub=4096 (d8b12): k-means on 8 points per centroid and 10 iterations keeps calibration in minutes.
  [ "$p" = d8b12 ] && o="$o --iters 10 --max-points-per-centroid 8"
  case "$p" in d4b8_k4_L*) r=${p#d4b8_k4_L}; o="$o --keys-layers d2b8:${r/_/-}";; esac
  [ "$p" = d4b8_plain ] && o="$o --key-norm 0 --value-norm 0"
  also+=(--also "$o -o $out/cb_$p.safetensors")
done
# --ctx 4096: keys are stored after RoPE, so the codebooks should see every position the cache will
# hold (calibrated at 2048, the 2-bit cache loses 128% ppl at ctx 4096 instead of 104%).
"$kvpq" calibrate --model "$model" --text data/text/emma.txt --tokens "$calib_tokens" --ctx 4096 \
  --keys d4b8 --threads "$threads" -o "$out/cb_d4b8.safetensors" "${also[@]}" 2>&1 |
  tr '\r' '\n' | grep 'wrote' | tee "$out/calibrate.txt"

# Every preset with the default window of 128 fp16 tokens, and the 2-bit presets with a window of 64
# (:w64): at ctx 4096 the 128-token fp16 window (a ring of 160 slots) alone is 3.9% of the fp16 cache,
# so 2-bit codes (12.5%) plus that window cannot be under 0.15x of it; the :w64 rows show what the
# smaller window costs, with and without the per-vector scales (1.6%).
caches="fp16,q8_0,q4_0,q8_0r,q4_0r,kivi4,kivi2"
for p in $presets; do caches="$caches,vq:$out/cb_$p.safetensors"; done
caches="$caches,vq:$out/cb_d4b8.safetensors:w64,vq:$out/cb_d4b8_plain.safetensors:w64"
for ctx in 1024 4096; do
  chunks=$chunks1k; [ "$ctx" = 4096 ] && chunks=$chunks4k
  echo "== perplexity on data/text/persuasion.txt, ctx $ctx, $chunks chunks, KL against the fp16 cache"
  "$kvpq" ppl --model "$model" --text data/text/persuasion.txt --ctx "$ctx" --chunks "$chunks" \
    --cache "$caches" --kl-base fp16 --threads "$threads" --json > "$out/ppl_ctx$ctx.json"
done

# Peer rows: the fp16 cache is the KL base (its row is written from the base run, scripts/peer_rows.py).
mkdir -p "$out/peers"
for name in $peer_models; do
  case "$name" in
    smollm2-135m) m=models/SmolLM2-135M-Instruct.Q4_1.gguf; tag=smollm2-135m; ctxs="1024 4096";;
    qwen2.5-coder-1.5b) m=models/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf; tag=qwen2.5-coder-1.5b; ctxs=4096;;
    gemma3-270m) m=models/gemma-3-270m-Q4_K_M.gguf; tag=gemma3-270m; ctxs=4096;;
    *) echo "main_job: PEER_MODELS: unknown model '$name'" >&2; exit 2;;
  esac
  for ctx in $ctxs; do
    chunks=$chunks_peer4k; [ "$ctx" = 1024 ] && chunks=$chunks1k
    echo "== peers: $tag, ctx $ctx, $chunks chunks"
    "$kvpq" ppl --model "$m" --text data/text/persuasion.txt --ctx "$ctx" --chunks "$chunks" \
      --cache q8_0,q4_0,q8_0r,q4_0r,kivi2,kivi4 --kl-base fp16 --threads "$threads" --json --quiet \
      > "$out/peers/ppl_${tag}_ctx$ctx.json"
    python3 scripts/peer_rows.py --model "$tag" --ctx "$ctx" --table -o "$out/peers/${tag}_ctx${ctx}_peers.json" \
      "$out/peers/ppl_${tag}_ctx$ctx.json"
  done
done

echo "== table"
python3 scripts/report.py --out "$out" --readme README.md --figure docs/main_job.png \
  --calib-log "$out/calibrate.txt" --command "./scripts/main_job.sh" "$out"/ppl_ctx1024.json "$out"/ppl_ctx4096.json

echo "== generate with the 2-bit VQ cache (d4b8)"
"$kvpq" generate --model "$model" --cache "vq:$out/cb_d4b8.safetensors" --threads "$threads" -n 160 --temp 0 \
  --prompt "It was a bright morning in the village when" | tee "$out/generate_2bit.txt"
echo
