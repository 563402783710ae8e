#!/usr/bin/env python3
"""Is a VQ cache's loss on a model a defect of attention from codes, or only its reconstruction error?

At context L (default 4096) on the held-out text, the model runs the prefix into a VQ cache (codebook
FILE, fp16 window W), then each of the next T tokens is evaluated
  - into the VQ cache (attention from codes),
  - into a float32 cache holding the VQ cache's own reconstruction after that step (`Cache.read`:
    decoded codes, un-rotated, un-smoothed, plus the fp16 window; positions a sliding-window layer has
    dropped are zeros there, masked the same way),
  - into a float32 cache of the exact keys and values.
KL(vq || fp32 over reconstruction) at float32 rounding means the coded path is exact with respect to
its reconstruction, so the whole loss KL(exact || vq) is the codes' error. The budget split says where
the effective bits go: the fp16 window ring (window + 32 slots per layer, src/cache/cache_vq.c) against
codes, scales and codebooks.

    OMP_WAIT_POLICY=PASSIVE KVPQ_LIB=build/libkvpq_model.so PYTHONPATH=python \\
        python3 bench/vq_model_consistency.py --model models/gemma-3-270m-Q4_K_M.gguf \\
        --codebook out/gemma_b3.0.safetensors --ctx 4096 --json out.json

Output: one JSON object (schema kvpq.vq_consistency/1) on stdout or --json."""
import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import kvpq  # noqa: E402

VQ_FLUSH = 32  # src/cache/cache_vq.c: the ring holds window + VQ_FLUSH slots


def kl(p_logits, q_logits):
    """KL(softmax(p) || softmax(q)) in float64, nats."""
    a = p_logits.astype(np.float64) - p_logits.max()
    b = q_logits.astype(np.float64) - q_logits.max()
    la = a - np.log(np.exp(a).sum())
    lb = b - np.log(np.exp(b).sum())
    return float((np.exp(la) * (la - lb)).sum())


def held_from(cache, layer, n):
    """The first position a layer still holds (sliding-window layers drop whole pages of old ones)."""
    try:
        cache.read(layer, 0, 1)
        return 0
    except kvpq.Error as e:
        m = re.search(r"positions before (\d+)", str(e))
        if not m:
            raise
        return int(m.group(1))


def fp32_copy(m, cache, n, max_seq):
    """A float32 cache holding positions [0, n) of `cache` as its attention reads them (positions a
    sliding-window layer has dropped as zeros: no query reads them)."""
    c = m.new_cache("fp32", max_seq=max_seq)
    nkv, hd = m.info["n_head_kv"], m.info["head_dim"]
    for layer in range(m.info["n_layer"]):
        lo = held_from(cache, layer, n)
        k, v = cache.read(layer, lo, n - lo)
        if lo:
            z = np.zeros((lo, nkv, hd), np.float32)
            k, v = np.concatenate([z, k]), np.concatenate([z, v])
        c.append(layer, k, v)
    return c


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--codebook", required=True)
    ap.add_argument("--text", default="data/text/persuasion.txt")
    ap.add_argument("--ctx", type=int, default=4096, help="positions before the last scored token")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=4, help="T: tokens compared after the prefix")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    t0 = time.process_time()
    m = kvpq.Model(a.model, n_threads=a.threads)
    cb = kvpq.Codebook.load(a.codebook)
    info = m.info
    toks = m.tokenize(Path(a.text).read_text(encoding="utf-8"), info["add_bos"])
    n0, T = a.ctx - a.tokens, a.tokens
    if len(toks) < a.ctx:
        sys.exit(f"vq_model_consistency: {a.text} has {len(toks)} tokens, --ctx {a.ctx} needs more")
    toks = toks[:a.ctx]
    vq = m.new_cache("vq", max_seq=a.ctx, codebook=cb, window=a.window)
    ex = m.new_cache("fp32", max_seq=a.ctx)
    m.eval(vq, toks[:n0])
    m.eval(ex, toks[:n0])
    rows = []
    for t in range(T):
        n = n0 + t
        p_vq = m.eval(vq, toks[n:n + 1])
        p_ex = m.eval(ex, toks[n:n + 1])
        p_rec = m.eval(fp32_copy(m, vq, n, a.ctx), toks[n:n + 1])
        rows.append({"pos": n, "kl_exact_vq": kl(p_ex, p_vq), "kl_vq_recon": kl(p_vq, p_rec),
                     "max_abs_logit_vq_recon": float(np.abs(p_vq - p_rec).max()),
                     "top1_vq_eq_recon": bool(p_vq.argmax() == p_rec.argmax())})
    st = vq.stats()
    nl, nkv, hd = info["n_layer"], info["n_head_kv"], info["head_dim"]
    ring = 2 * (a.window + VQ_FLUSH) * nkv * hd * 2 * nl  # K and V, fp16, every layer
    out = {"schema": "kvpq.vq_consistency/1", "model": a.model, "codebook": a.codebook, "text": a.text,
           "ctx": a.ctx, "window": a.window,
           "model_shape": {"n_layer": nl, "n_head": info["n_head"], "n_head_kv": nkv, "head_dim": hd},
           "codebook_meta": {k: v for k, v in cb.meta().items() if k in ("keys", "values", "alloc.bits", "alloc.k",
                                                                           "alloc.v", "alloc.effective_bits")},
           "rows": rows,
           "kl_exact_vq_mean": float(np.mean([r["kl_exact_vq"] for r in rows])),
           "kl_vq_recon_max": float(max(r["kl_vq_recon"] for r in rows)),
           "cache": {"resident_bytes": st["resident_bytes"], "elements": st["elements"],
                     "bits_per_element": st["bits_per_element"], "tokens_coded": st["tokens_coded"],
                     "tokens_window": st["tokens_window"], "window_ring_bytes": ring,
                     "window_ring_share": ring / st["resident_bytes"],
                     "window_ring_bits": 8.0 * ring / st["elements"],
                     "other_bits": 8.0 * (st["resident_bytes"] - ring) / st["elements"]},
           "cpu_s": time.process_time() - t0}
    s = json.dumps(out, indent=1)
    if a.json:
        Path(a.json).write_text(s + "\n")
    print(s)


if __name__ == "__main__":
    main()
