#!/usr/bin/env python3
"""transformers_ppl_parity.py: where the perplexity of KVPQCache (transformers) and `kvpq ppl --cache vq:`
(kvpq's engine) part, chunk by chunk, in one process.

Same token ids (kvpq's tokenizer, BOS as `kvpq ppl`), same chunks (llama.cpp's: non-overlapping ctx
tokens, first replaced by BOS, second half scored), same two-call evaluation of each chunk (positions
[0, ctx/2) then [ctx/2, ctx)), same codebook, window and max_seq (= ctx, as the CLI's cache). Runs:

  engine            kvpq.Model.eval with a vq kvpq.Cache (what `kvpq ppl` does; checked equal to it)
  engine avx2/scalar  the same at other SIMD levels: only the rounding of the forward pass changes
  KVPQCache         transformers (float32, from the GGUF) with kvpq.transformers.KVPQCache
  KVPQCache +noise s  the same with every key multiplied by (1 + 2^-22 e), e ~ N(0,1) (seed s): a
                    perturbation of the size of the two forward passes' own difference
  fp32 / Dynamic    both without codes (kvpq fp32 cache, transformers DynamicCache)

For each run against "engine": the relative perplexity difference and the paired per-chunk mean-NLL
difference with its standard error over chunks (a difference of pure rounding noise has a mean
within ~2 SE of 0 and shrinks as 1/sqrt(chunks)). Also the layer-0 key code flip rate: the keys of
layer 0 (which no earlier attention affects) from both forward passes, coded by the codebook: the
fraction of (position, KV head) rows whose codes differ.

usage: python3 bench/transformers_ppl_parity.py --codebook CB [--text F] [--ctx 512] [--chunks 8]
           [--noise-seeds 2] [--threads 2] [--json OUT]
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
if os.path.join(ROOT, "python") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "python"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--codebook", required=True)
    ap.add_argument("--text", default=os.path.join(ROOT, "data", "text", "emma.txt"))
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--noise-seeds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("--no-cli", action="store_true", help="skip the check against the kvpq CLI")
    ap.add_argument("--pair-only", action="store_true", help="only engine and KVPQCache (more chunks, less time)")
    a = ap.parse_args()

    import torch
    import kvpq
    from kvpq.transformers import KVPQCache
    from llama_cpp_peer import chunks_of, score_chunk
    from transformers import DynamicCache
    from transformers_peer import MODEL_DIR, MODEL_FILE, load_hf

    path = os.path.join(MODEL_DIR, MODEL_FILE)
    model = load_hf(a.threads)
    eng = kvpq.Model(path, n_threads=a.threads)
    info = eng.info
    toks = eng.tokenize(open(a.text, encoding="utf-8").read(), add_bos=bool(info["add_bos"])).tolist()
    chunks = chunks_of(toks, a.ctx, a.chunks, info["bos_id"], info["add_bos"])
    cb = kvpq.Codebook.load(a.codebook)
    first = a.ctx // 2

    def run_engine(kind, simd=None):
        prev = kvpq.simd_get()
        if simd:
            kvpq.simd_set(simd)
        try:
            per = []
            for ch in chunks:
                c = eng.new_cache(kind, max_seq=a.ctx, codebook=cb if kind == "vq" else None)
                eng.eval(c, np.array(ch[:first], np.int32))
                lg = eng.eval(c, np.array(ch[first:], np.int32), logits_all=True)
                full = np.zeros((len(ch), lg.shape[1]), np.float32)
                full[first:] = lg
                per.append(score_chunk(full, ch))
            return per
        finally:
            kvpq.simd_set(prev)

    class NoisyKVPQCache(KVPQCache):
        """KVPQCache whose stored keys get a relative perturbation of 2^-22 (about the float32
        rounding difference of two forward passes), so one sees how much the coded result moves."""

        def __init__(self, *args, seed=0, **kw):
            super().__init__(*args, **kw)
            self._gen = torch.Generator().manual_seed(seed)

        def update(self, key_states, value_states, layer_idx, *args, **kw):
            e = torch.randn(key_states.shape, generator=self._gen) * 2.0 ** -22
            return super().update(key_states * (1 + e), value_states, layer_idx, *args, **kw)

    def run_hf(make):
        per = []
        with torch.no_grad():
            for ch in chunks:
                cache = make()
                model(torch.tensor([ch[:first]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
                lg = model(torch.tensor([ch[first:]]), past_key_values=cache, use_cache=True).logits[0].numpy()
                full = np.zeros((len(ch), lg.shape[1]), np.float32)
                full[first:] = lg
                per.append(score_chunk(full, ch))
        return per

    runs = {}
    t0 = time.perf_counter()
    runs["engine"] = run_engine("vq")
    for level in () if a.pair_only else ("avx2", "scalar"):
        if level != kvpq.simd_get():
            runs[f"engine {level}"] = run_engine("vq", level)
    runs["KVPQCache"] = run_hf(lambda: KVPQCache(cb, model, max_seq=a.ctx))
    for s in range(0 if a.pair_only else a.noise_seeds):
        runs[f"KVPQCache +noise {s}"] = run_hf(lambda: NoisyKVPQCache(cb, model, max_seq=a.ctx, seed=s))
    if not a.pair_only:
        runs["engine fp32"] = run_engine("fp32")
        model.set_attn_implementation("sdpa")
        runs["DynamicCache"] = run_hf(lambda: DynamicCache(config=model.config))
    secs = time.perf_counter() - t0

    # layer-0 key codes from both forward passes (window 0: every position coded)
    ch = chunks[0]
    c_eng = eng.new_cache("fp32", max_seq=a.ctx)
    eng.eval(c_eng, np.array(ch, np.int32))
    k_eng = c_eng.read(0)[0]
    from kvpq.transformers import collect_kv
    k_hf = collect_kv(model, torch.tensor(ch), a.ctx)[0][0]
    ko = KVPQCache(cb, model, max_seq=a.ctx)
    k_hf = ko._key_order(k_hf)  # the engine's channel order
    rel = float(np.abs(k_hf - k_eng).max() / np.abs(k_eng).max())
    coded = []
    for k in (k_eng, k_hf):
        c = kvpq.Cache("vq", cb.n_layer, info["n_head"], cb.n_head_kv, cb.head_dim, a.ctx, codebook=cb, window=0)
        c.append(0, np.ascontiguousarray(k), np.zeros_like(k))
        coded.append(c.read(0)[0])
    flips = float((np.abs(coded[0] - coded[1]).max(-1) > 0).mean())

    base = [np.mean(x) for x in runs["engine"]]
    ppl = {k: math.exp(np.mean(np.concatenate(v))) for k, v in runs.items()}
    rows = []
    for k, v in runs.items():
        d = np.array([np.mean(x) for x in v]) - base
        se = d.std(ddof=1) / math.sqrt(len(d)) if len(d) > 1 else float("nan")
        rows.append({"run": k, "ppl": ppl[k], "rel_vs_engine": ppl[k] / ppl["engine"] - 1,
                     "chunk_nll_diff_mean": float(d.mean()), "chunk_nll_diff_se": float(se)})
    res = {"ctx": a.ctx, "chunks": len(chunks), "codebook": os.path.basename(a.codebook), "text": os.path.basename(a.text),
           "rows": rows, "layer0_key_rel_diff": rel, "layer0_key_code_flip_rate": flips, "seconds": secs,
           "simd_default": kvpq.simd_get(), "per_chunk_nll": {k: [float(np.mean(x)) for x in v] for k, v in runs.items()}}
    if not a.no_cli:
        bin_ = os.environ.get("KVPQ_BIN", os.path.join(ROOT, "build", "kvpq"))
        p = subprocess.run([bin_, "ppl", "--model", path, "--text", a.text, "--ctx", str(a.ctx), "--chunks",
                            str(len(chunks)), "--threads", str(a.threads), "--json", "--quiet", "--cache",
                            f"vq:{a.codebook}"], capture_output=True, text=True, check=True)
        res["cli_vq_ppl"] = json.loads(p.stdout)["results"][0]["ppl"]
    print(f"ctx {a.ctx} x {len(chunks)} chunks of {res['text']}, codebook {res['codebook']}, default SIMD "
          f"{res['simd_default']}" + (f"; kvpq ppl CLI: {res['cli_vq_ppl']:.4f}" if "cli_vq_ppl" in res else ""))
    print(f"{'run':22s} {'ppl':>9s} {'vs engine':>10s} {'chunk dNLL mean':>16s} {'SE':>8s} {'mean/SE':>8s}")
    for r in rows:
        t = r["chunk_nll_diff_mean"] / r["chunk_nll_diff_se"] if r["chunk_nll_diff_se"] > 0 else float("nan")
        print(f"{r['run']:22s} {r['ppl']:9.4f} {100 * r['rel_vs_engine']:+9.3f}% {r['chunk_nll_diff_mean']:+16.5f} "
              f"{r['chunk_nll_diff_se']:8.5f} {t:+8.2f}")
    print(f"layer 0 keys, transformers vs engine: max |diff| / max |k| = {rel:.2e}; coded rows that differ: "
          f"{100 * flips:.3f}%")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
