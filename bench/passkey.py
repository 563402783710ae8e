"""Passkey retrieval at long context (issue 30 item 4; Mohtashami & Jaggi, "Landmark Attention",
2023, sec. 4.2): a random 5-digit number hidden at a depth of novel text, the model asked for it at
the end, the greedy answer an exact match or not. Every cache in the same run, the same prompts.

    python3 bench/passkey.py --model models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --cache fp16,tq3,vq:cb_2.5.safetensors --ctx 4096 --depth 0.1,0.5,0.9 --trials 20

Prints one row per (ctx, depth, cache): hits / trials; --json FILE writes them. The haystack is
data/text/persuasion.txt (held out from calibration, which reads emma.txt), repeated when shorter
than the context; each trial takes its own passkey and its own slice of the text (seeded). Caches:
any SPEC of the CLI's --cache (`kvpq.Model.new_cache` parses it with the library's grammar): a kind
(fp32 fp16 q8_0 q4_0 q8_0r q4_0r kivi2 kivi4), vq:FILE (a codebook, with its window and sinks),
tq2/tq3/tq4 (TurboQuant's MSE quantizer), each with :wN / :sN suffixes.
Uses the kvpq Python package over this build (KVPQ_LIB)."""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import kvpq

ROOT = Path(__file__).resolve().parents[1]
INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about it.\n\n")
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key? The pass key is"
PREFILL = 512  # tokens per eval call (the forward pass's scratch grows with the call's tokens)


def build_prompt(model, hay_ids, ctx, depth, key, rng):
    """Token ids of INTRO + haystack (with the needle at `depth`) + QUESTION, ctx tokens in all."""
    head, needle, tail = (model.tokenize(t) for t in (INTRO, NEEDLE.format(key=key), QUESTION))
    n_hay = ctx - len(head) - len(needle) - len(tail) - 1
    start = int(rng.integers(0, len(hay_ids) - n_hay))
    hay = hay_ids[start:start + n_hay]
    at = int(depth * n_hay)
    ids = np.concatenate([head, hay[:at], needle, hay[at:], tail]).astype(np.int32)
    if model.info["add_bos"]:
        ids = np.concatenate([[model.info["bos_id"]], ids]).astype(np.int32)
    return ids


def answer(model, cache, ids, n_new=8):
    """Greedy continuation of ids: the generated text."""
    for p in range(0, len(ids), PREFILL):
        logits = model.eval(cache, ids[p:p + PREFILL])
    out = []
    for _ in range(n_new):
        t = int(np.argmax(logits))
        if t == model.info["eos_id"]:
            break
        out.append(model.token_to_piece(t))
        logits = model.eval(cache, np.array([t], np.int32))
    return b"".join(out).decode("utf-8", "replace")


def run(args):
    model = kvpq.Model(args.model, n_threads=args.threads)
    text = (ROOT / "data" / "text" / "persuasion.txt").read_text(encoding="utf-8")
    hay_ids = model.tokenize(text)
    rows = []
    for ctx in args.ctx:
        reps = -(-(ctx + 1) // len(hay_ids)) + 1
        hay = np.tile(hay_ids, reps)
        for depth in args.depth:
            keys = np.random.default_rng(args.seed).integers(10000, 100000, args.trials)
            trials = [(int(k), build_prompt(model, hay, ctx, depth, int(k), np.random.default_rng(args.seed + i)))
                      for i, k in enumerate(keys)]
            for spec in args.cache:
                t0, hits = time.time(), 0
                for key, ids in trials:
                    cache = model.new_cache(spec, max_seq=ctx + 16)  # the CLI's --cache grammar
                    hits += str(key) in answer(model, cache, ids)
                rows.append({"ctx": ctx, "depth": depth, "cache": spec, "hits": hits, "trials": len(trials),
                             "seconds": round(time.time() - t0, 1)})
                r = rows[-1]
                print(f"ctx {ctx:6d} depth {depth:4.2f} {spec:28s} {hits:3d}/{len(trials)}  ({r['seconds']} s)",
                      flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--cache", default="fp16", type=lambda s: s.split(","))
    ap.add_argument("--ctx", default="4096", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--depth", default="0.1,0.5,0.9", type=lambda s: [float(x) for x in s.split(",")])
    ap.add_argument("--trials", default=20, type=int)
    ap.add_argument("--seed", default=1, type=int)
    ap.add_argument("--threads", default=0, type=int)
    ap.add_argument("--json", help="write the rows (and settings) to this file")
    args = ap.parse_args(argv)
    rows = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": {**vars(args), "date": time.strftime("%Y-%m-%d")},
                                               "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
