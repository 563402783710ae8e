#!/usr/bin/env python3
"""Per layer (SmolLM2, keys only coded d4b8 with query-aware smoothing, 1 sink, values exact): how much
of the attention KL goes away when a fraction F of positions keep exact keys, chosen by an oracle (the
attention they receive on the held-out text itself), by their coding error, by key norm, or online by
their cosine with the sequence's position-0 key (centered: sinkcos; raw: rawcos). Also the rank
correlation of received attention with those scores. Results: docs/vq_quality.md, "Sink-like positions".
Needs out/smooth_study (bench/smooth_study.py). Usage: KVPQ_LIB=build/libkvpq.so python3
bench/sink_like_layers.py 3,8,13"""
import os, sys, numpy as np
from pathlib import Path
SRC = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(SRC / "python")); sys.path.insert(0, str(SRC / "bench"))
os.environ.setdefault("KVPQ_LIB", str(SRC / "build" / "libkvpq.so"))
import kvpq
from smooth_study import transforms, code_norm_explicit
work = str(SRC / "out" / "smooth_study")
layers = [int(x) for x in sys.argv[1].split(",")]
fracs = [0.0, 0.01, 0.02, 0.05]
def attn(q, k, kh, t0, exact_mask):
    T, Hq, d = q.shape; g = Hq // k.shape[1]
    mask = np.arange(T)[None, :] > np.arange(t0, T)[:, None]
    kls = []; recv = np.zeros(T)
    for h in range(Hq):
        kv = h // g
        s = q[t0:, h] @ k[:, kv].T / np.sqrt(d)
        khh = np.where(exact_mask[:, kv, None], k[:, kv], kh[:, kv])
        sh = q[t0:, h] @ khh.T / np.sqrt(d)
        s[mask] = -np.inf; sh[mask] = -np.inf
        p = np.exp(s - s.max(1, keepdims=True)); p /= p.sum(1, keepdims=True)
        ph = np.exp(sh - sh.max(1, keepdims=True)); ph /= ph.sum(1, keepdims=True)
        lp, lph = np.log(np.maximum(p, 1e-300)), np.log(np.maximum(ph, 1e-300))
        kls.append(np.sum(np.where(p > 0, p * (lp - lph), 0), 1).mean())
    return np.mean(kls)
def received(q, k, t0):
    T, Hq, d = q.shape; g = Hq // k.shape[1]
    mask = np.arange(T)[None, :] > np.arange(t0, T)[:, None]
    r = np.zeros((T, k.shape[1]))
    for h in range(Hq):
        kv = h // g
        s = q[t0:, h] @ k[:, kv].T / np.sqrt(d); s[mask] = -np.inf
        p = np.exp(s - s.max(1, keepdims=True)); p /= p.sum(1, keepdims=True)
        r[:, kv] += p.sum(0)
    return r
for layer in layers:
    c, t = np.load(f"{work}/cal_L{layer}.npz"), np.load(f"{work}/test_L{layer}.npz")
    qc, kc = c["q"].astype(np.float64), c["k"].astype(np.float64)
    qt, kt = (t[x].astype(np.float64) for x in "qk")
    H = kvpq.hadamard(np.eye(kc.shape[2], dtype=np.float32)).astype(np.float64)
    f, finv = transforms("query", qc, kc, H)
    kh = finv(code_norm_explicit(kvpq, f(kc), f(kt), "d4b8"))
    T = kt.shape[0]; t0 = T // 2
    relerr = np.linalg.norm(kh - kt, axis=-1) / np.linalg.norm(kt - kc.mean(0), axis=-1)  # (T, hkv)
    abserr = np.linalg.norm(kh - kt, axis=-1)
    knorm = np.linalg.norm(kt - kc.mean(0), axis=-1)
    rec = received(qt, kt, t0)
    kcen = kt - kc.mean(0)
    sinkcos = np.einsum("nhd,hd->nh", kcen, kcen[0]) / np.maximum(np.linalg.norm(kcen, axis=-1) * np.linalg.norm(kcen[0], axis=-1), 1e-30)
    rawcos = np.einsum("nhd,hd->nh", kt, kt[0]) / np.maximum(np.linalg.norm(kt, axis=-1) * np.linalg.norm(kt[0], axis=-1), 1e-30)
    import scipy.stats
    print(layer, "corr(recv, sinkcos)", [round(scipy.stats.spearmanr(rec[:t0*2, h], sinkcos[:, h])[0], 3) for h in range(kt.shape[1])],
          "corr(recv, rawcos)", [round(scipy.stats.spearmanr(rec[:, h], rawcos[:, h])[0], 3) for h in range(kt.shape[1])],
          "corr(recv,knorm)", [round(scipy.stats.spearmanr(rec[:, h], knorm[:, h])[0], 3) for h in range(kt.shape[1])])
    out = []
    base = np.zeros((T, kt.shape[1]), bool); base[0] = True
    for name, score in (("oracle", rec), ("relerr", relerr), ("abserr", abserr), ("knorm", knorm), ("sinkcos", sinkcos), ("rawcos", rawcos)):
        for fr in fracs:
            if fr == 0 and name != "oracle": continue
            m = base.copy()
            n = int(fr * T)
            if n:
                for kv in range(kt.shape[1]):
                    sc = score[:, kv].copy(); sc[0] = -1
                    m[np.argsort(-sc)[:n], kv] = True
            out.append(f"{name}{fr:.2f}={attn(qt, kt, kh, t0, m):.4f}")
    print(layer, " ".join(out), flush=True)
