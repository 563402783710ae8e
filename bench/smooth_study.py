#!/usr/bin/env python3
"""Which smoothing factors make 2-bit PQ keys cost attention the least? A per-layer study on real
activations (docs/vq_quality.md, "Query-aware smoothing").

For each layer: post-RoPE queries, keys and values of SmolLM2-135M (transformers loads the GGUF,
dequantized, float32; a custom attention function records q, k, v) on calibration text (emma) and
held-out text (persuasion), 2048 tokens each. Keys are centered (per KV head and channel), divided by
smoothing factors, Hadamard-rotated, coded norm-explicit with a kvpq.ProductQuantizer (default d4b8,
shared codebook) trained on the calibration keys, and decoded back. On the held-out text, causal
attention of every query head at positions 1024..2047 with the exact keys is compared with the
decoded keys (exact values): mean KL of the attention distributions, relative output error
|o - o'|^2 / |o|^2, and mean squared score error (scores scaled by 1/sqrt(head_dim)).

Methods (--methods): keys = VecInfer's lambda_c = sqrt(max|k_c|) (kvpq_smooth_compute); query =
lambda_c^2 = max|k_c| / max|q_c| (SmoothQuant's alpha = 0.5; kvpq_smooth_compute_qk, up to a
per-head scale that norm-explicit coding ignores); query_rms = the same with RMS instead of max;
whiten = keys multiplied by Sigma_q^(1/2) (queries by its inverse; Sigma_q the query second moment
of the KV head's group); whiten_half = Sigma_q^(1/4).

Usage: KVPQ_LIB=build/libkvpq.so python3 bench/smooth_study.py --model-dir models
       --model-file SmolLM2-135M-Instruct.Q4_1.gguf --work out/smooth [--layers 0-29] [--preset d4b8]
Needs torch, transformers and gguf (python/requirements-transformers.txt) and the kvpq package (python/).
"""
import argparse
import os
import sys
from pathlib import Path

import numpy as np

SRC = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(SRC / "python"))


def capture(model_dir, model_file, work, texts):
    import torch
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    tok = AutoTokenizer.from_pretrained(model_dir, gguf_file=model_file)
    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=model_file, dtype=torch.float32)
    store = {}

    def cap(module, q, k, v, mask, **kw):  # (1, heads, T, head_dim) after RoPE
        store[module.layer_idx] = tuple(x[0].transpose(0, 1).numpy().copy() for x in (q, k, v))
        return sdpa_attention_forward(module, q, k, v, mask, **kw)

    AttentionInterface.register("kvpq_capture", cap)
    model.set_attn_implementation("kvpq_capture")
    for name, path, n in texts:
        ids = tok(Path(path).read_text(encoding="utf-8")[:400000], return_tensors="pt").input_ids[:, :n]
        store.clear()
        with torch.no_grad():
            model(ids)
        for layer, (q, k, v) in store.items():
            np.savez(work / f"{name}_L{layer}.npz", q=q, k=k, v=v)


def transforms(method, qc, kc, H):
    """(forward, inverse) maps of keys (n, n_head_kv, d) into the space that is rotated and coded."""
    mu = kc.mean(0)
    g = qc.shape[1] // kc.shape[1]
    d = kc.shape[2]
    qg = qc.reshape(qc.shape[0], kc.shape[1], g, d)
    if method in ("keys", "query", "query_rms"):
        if method == "keys":
            lam = np.maximum(np.sqrt(np.abs(kc - mu).max(0)), 1e-2)
        elif method == "query":
            lam = np.sqrt(np.abs(kc - mu).max(0) / np.maximum(np.abs(qg).max((0, 2)), 1e-6))
        else:
            lam = np.sqrt(np.sqrt(((kc - mu) ** 2).mean(0)) / np.maximum(np.sqrt((qg ** 2).mean((0, 2))), 1e-6))
        lam = np.maximum(lam, 1e-6)
        return (lambda k: ((k - mu) / lam) @ H.T), (lambda y: (y @ H) * lam + mu)
    power = {"whiten": 0.5, "whiten_half": 0.25}[method]
    A, Ai = [], []
    for h in range(kc.shape[1]):
        Q = qg[:, h].reshape(-1, d)
        w, V = np.linalg.eigh(Q.T @ Q / len(Q))
        w = np.maximum(w, w.max() * 1e-6)
        A.append(V @ np.diag(w ** power) @ V.T)
        Ai.append(V @ np.diag(w ** -power) @ V.T)
    A, Ai = np.stack(A), np.stack(Ai)
    return (lambda k: np.einsum("hij,nhj->nhi", A, k - mu) @ H.T), \
           (lambda y: np.einsum("hij,nhj->nhi", Ai, y @ H) + mu)


def code_norm_explicit(kvpq, Xc, Xt, preset):
    d = Xc.shape[-1]
    unit = lambda X: X / np.maximum(np.linalg.norm(X, axis=-1, keepdims=True), 1e-30)
    pq = kvpq.ProductQuantizer(d=d, preset=preset)
    pq.train(np.ascontiguousarray(unit(Xc).reshape(-1, d), dtype=np.float32))
    U = np.ascontiguousarray(unit(Xt).reshape(-1, d), dtype=np.float32)
    R = pq.decode(pq.encode(U)).reshape(Xt.shape).astype(np.float64)
    return unit(R) * np.linalg.norm(Xt, axis=-1, keepdims=True)


def attention_error(q, k, kh, v, t0):
    T, Hq, d = q.shape
    g = Hq // k.shape[1]
    mask = np.arange(T)[None, :] > np.arange(t0, T)[:, None]
    kl, oe, se = [], [], []
    for h in range(Hq):
        kv = h // g
        s = q[t0:, h] @ k[:, kv].T / np.sqrt(d)
        sh = q[t0:, h] @ kh[:, kv].T / np.sqrt(d)
        se.append(np.mean((s - sh)[~mask] ** 2))
        s[mask] = -np.inf
        sh[mask] = -np.inf
        p = np.exp(s - s.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        ph = np.exp(sh - sh.max(1, keepdims=True))
        ph /= ph.sum(1, keepdims=True)
        lp, lph = np.log(np.maximum(p, 1e-300)), np.log(np.maximum(ph, 1e-300))
        kl.append(np.sum(np.where(p > 0, p * (lp - lph), 0), 1).mean())
        o, oh = p @ v[:, kv], ph @ v[:, kv]
        oe.append((np.sum((o - oh) ** 2, 1) / np.sum(o ** 2, 1)).mean())
    return np.mean(kl), np.mean(oe), np.mean(se)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=str(SRC / "models"))
    ap.add_argument("--model-file", default="SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--work", default=str(SRC / "out" / "smooth_study"))
    ap.add_argument("--calib", default=str(SRC / "data" / "text" / "emma.txt"))
    ap.add_argument("--held-out", default=str(SRC / "data" / "text" / "persuasion.txt"))
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", default="0-29")
    ap.add_argument("--preset", default="d4b8")
    ap.add_argument("--methods", default="keys,query")
    a = ap.parse_args()
    os.environ.setdefault("KVPQ_LIB", str(SRC / "build" / "libkvpq.so"))
    import kvpq
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "cal_L0.npz").exists():
        capture(a.model_dir, a.model_file, work, [("cal", a.calib, a.tokens), ("test", a.held_out, a.tokens)])
    lo, hi = (int(x) for x in a.layers.split("-")) if "-" in a.layers else (int(a.layers),) * 2
    methods = a.methods.split(",")
    sums = {m: [] for m in methods}
    print("layer | " + " | ".join(f"{m}: attn KL, out err, score MSE" for m in methods))
    for layer in range(lo, hi + 1):
        c, t = np.load(work / f"cal_L{layer}.npz"), np.load(work / f"test_L{layer}.npz")
        qc, kc = c["q"].astype(np.float64), c["k"].astype(np.float64)
        qt, kt, vt = (t[x].astype(np.float64) for x in "qkv")
        H = kvpq.hadamard(np.eye(kc.shape[2], dtype=np.float32)).astype(np.float64)  # the cache's rotation
        row = []
        for m in methods:
            f, finv = transforms(m, qc, kc, H)
            kh = finv(code_norm_explicit(kvpq, f(kc), f(kt), a.preset))
            r = attention_error(qt, kt, kh, vt, qt.shape[0] // 2)
            sums[m].append(r)
            row.append("%.4f %.4f %.4f" % r)
        print(f"{layer:5d} | " + " | ".join(row), flush=True)
    base = np.array(sums[methods[0]])
    for m in methods:
        r = np.array(sums[m])
        print(f"{m}: mean attn KL {r[:, 0].mean():.4f} (per-layer change vs {methods[0]}: "
              f"{100 * np.mean(r[:, 0] / base[:, 0] - 1):+.1f}%, range {100 * np.min(r[:, 0] / base[:, 0] - 1):+.1f}% "
              f"to {100 * np.max(r[:, 0] / base[:, 0] - 1):+.1f}%), score MSE {r[:, 2].mean():.4f}")


if __name__ == "__main__":
    main()
