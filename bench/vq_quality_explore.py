#!/usr/bin/env python3
"""Explore what limits VQ cache quality, with an independent numpy simulation of the pipeline.

Runs the numpy Llama forward pass of bench/llama_cpp_peer.py (weights dequantized by the PyPI
`gguf` package) on SmolLM2, collects post-RoPE keys and values on the calibration novel, trains
codebooks with faiss k-means, and re-runs the held-out novel with the keys and values replaced by
their PQ reconstructions (all positions except the newest `window`), as the VQ cache attends them.
Prints perplexity, change against the unquantized run, KL and top-1 agreement per configuration.

usage: bench/vq_quality_explore.py CTX '[{"dsub":4,"nbits":8}, {"dsub":4,"nbits":8,"center":true}]'
config keys: dsub, nbits, sub (per-sub-space codebooks), vrot (rotate values), perhead (codebook per
KV head), smooth (default true), rot (default true), center (subtract the per-channel key mean),
sink (first tokens kept exact), window (default 128), qk / qv (quantize keys / values, default true).
Environment: KVPQ_LIB (default build/libkvpq.so) for tokenization.
"""
import os
import sys, math, time
import numpy as np
import faiss
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'bench'))
from llama_cpp_peer import NumpyLlama
M = os.path.join(ROOT, 'models', 'SmolLM2-135M-Instruct.Q4_1.gguf')
np.random.seed(0)
L = NumpyLlama(M)
# tokenize with kvpq via ctypes
from llama_cpp_peer import Kvpq
kv = Kvpq(os.environ.get('KVPQ_LIB', os.path.join(ROOT, 'build', 'libkvpq.so')), M, 2)

def fwd(tokens, hook=None, collect=None):
    self = L; n = len(tokens); w = self.w
    hd, H, Hk = self.head_dim, self.n_head, self.n_head_kv
    x = w["token_embd.weight"][np.asarray(tokens)]
    pos = np.arange(n, dtype=np.float64)
    mask = np.triu(np.full((n, n), -np.inf, dtype=np.float32), 1)
    for l in range(self.n_layer):
        p = f"blk.{l}."
        h = self.rmsnorm(x, w[p + "attn_norm.weight"])
        q = self.rope((h @ w[p + "attn_q.weight"].T).reshape(n, H, hd), pos)
        k = self.rope((h @ w[p + "attn_k.weight"].T).reshape(n, Hk, hd), pos)
        v = (h @ w[p + "attn_v.weight"].T).reshape(n, Hk, hd)
        if collect is not None: collect[l].append((k.copy(), v.copy()))
        if hook is not None: k, v = hook(l, k, v)
        g = H // Hk
        att = np.empty((n, H, hd), dtype=np.float32)
        for hh in range(H):
            s = q[:, hh, :] @ k[:, hh // g, :].T / math.sqrt(hd) + mask
            s = np.exp(s - s.max(-1, keepdims=True)); s /= s.sum(-1, keepdims=True)
            att[:, hh, :] = s @ v[:, hh // g, :]
        x = x + att.reshape(n, H * hd) @ w[p + "attn_output.weight"].T
        h = self.rmsnorm(x, w[p + "ffn_norm.weight"])
        gt = h @ w[p + "ffn_gate.weight"].T; up = h @ w[p + "ffn_up.weight"].T
        x = x + (gt / (1 + np.exp(-gt)) * up) @ w[p + "ffn_down.weight"].T
    return self.rmsnorm(x, w["output_norm.weight"]) @ w["output.weight"].T

def had(d):
    Hm = np.array([[1.0]])
    while Hm.shape[0] < d: Hm = np.block([[Hm, Hm], [Hm, -Hm]])
    return (Hm / math.sqrt(d)).astype(np.float32)
HD = had(64)

calib_text = open(os.path.join(ROOT, 'data', 'text', 'emma.txt')).read()
ev_text = open(os.path.join(ROOT, 'data', 'text', 'persuasion.txt')).read()
CT = kv.tokenize(calib_text[:200000], False)
ET = kv.tokenize(ev_text, False)
CTX = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
NCAL = 2; NCH = 2
t0 = time.time()
col = [[] for _ in range(30)]
for c in range(NCAL):
    fwd(CT[c*2048:(c+1)*2048], collect=col)
K = [np.concatenate([a for a, b in col[l]]) for l in range(30)]   # (N, Hk, hd)
V = [np.concatenate([b for a, b in col[l]]) for l in range(30)]
print('calib fwd', time.time()-t0, K[0].shape, flush=True)

def kmeans(x, k, niter=25):
    km = faiss.Kmeans(x.shape[1], k, niter=niter, seed=1, max_points_per_centroid=256)
    km.train(np.ascontiguousarray(x, dtype=np.float32)); return km

class PQ:
    def __init__(self, X, dsub, nbits, sub):  # X (N, d)
        self.dsub = dsub; self.sub = sub; d = X.shape[1]; self.M = d // dsub
        if sub:
            self.km = [kmeans(X[:, m*dsub:(m+1)*dsub], 2**nbits) for m in range(self.M)]
        else:
            self.km = kmeans(X.reshape(-1, dsub), 2**nbits)
    def rec(self, X):
        n, d = X.shape
        if self.sub:
            out = np.empty_like(X)
            for m in range(self.M):
                _, I = self.km[m].index.search(np.ascontiguousarray(X[:, m*self.dsub:(m+1)*self.dsub]), 1)
                out[:, m*self.dsub:(m+1)*self.dsub] = self.km[m].centroids[I[:, 0]]
            return out
        _, I = self.km.index.search(np.ascontiguousarray(X.reshape(-1, self.dsub)), 1)
        return self.km.centroids[I[:, 0]].reshape(n, d)

def build(cfg):
    dsub, nbits, sub, vrot, perhead, kdsub = cfg['dsub'], cfg['nbits'], cfg.get('sub', False), cfg.get('vrot', False), cfg.get('perhead', False), cfg.get('kdsub', cfg['dsub'])
    S = []
    for l in range(30):
        k = K[l]; v = V[l]
        mu = k.mean(0) if cfg.get('center') else np.zeros(k.shape[1:], np.float32)
        k = k - mu
        lam = np.maximum(np.sqrt(np.abs(k).max(0)), 1e-2) if cfg.get('smooth', True) else np.ones(k.shape[1:], np.float32)  # (Hk, hd)
        kt = (k / lam) @ HD.T if cfg.get('rot', True) else k / lam
        vt = v @ HD.T if vrot else v
        if perhead:
            kq = [PQ(kt[:, h], kdsub, nbits, sub) for h in range(3)]; vq = [PQ(vt[:, h], dsub, nbits, sub) for h in range(3)]
        else:
            kq = PQ(kt.reshape(-1, 64), kdsub, nbits, sub); vq = PQ(vt.reshape(-1, 64), dsub, nbits, sub)
        S.append((lam, kq, vq, mu))
    return S

def make_hook(S, cfg):
    sink = cfg.get('sink', 0); W = cfg.get('window', 128); vrot = cfg.get('vrot', False); perhead = cfg.get('perhead', False)
    qk = cfg.get('qk', True); qv = cfg.get('qv', True)
    def hook(l, k, v):
        lam, kq, vq, mu = S[l]; n = k.shape[0]
        lo, hi = sink, max(sink, n - W)
        if hi <= lo: return k, v
        k = k.copy(); v = v.copy()
        kt = ((k[lo:hi] - mu) / lam) @ HD.T if cfg.get('rot', True) else (k[lo:hi] - mu) / lam
        vt = v[lo:hi] @ HD.T if vrot else v[lo:hi]
        if perhead:
            kr = np.stack([kq[h].rec(kt[:, h]) for h in range(3)], 1); vr = np.stack([vq[h].rec(vt[:, h]) for h in range(3)], 1)
        else:
            kr = kq.rec(kt.reshape(-1, 64)).reshape(kt.shape); vr = vq.rec(vt.reshape(-1, 64)).reshape(vt.shape)
        if qk: k[lo:hi] = ((kr @ HD) if cfg.get('rot', True) else kr) * lam + mu
        if qv: v[lo:hi] = (vr @ HD) if vrot else vr
        return k, v
    return hook

def nll_chunks(hook):
    out = []
    for c in range(NCH):
        ch = ET[c*CTX:(c+1)*CTX]
        lg = fwd(ch, hook=hook)
        lg = lg - lg.max(-1, keepdims=True); lp = lg - np.log(np.exp(lg).sum(-1, keepdims=True))
        first = CTX // 2
        out.append((lp[first:CTX-1], np.array(ch[first+1:CTX])))
    return out

def score(res, base):
    nll = np.concatenate([-lp[np.arange(len(t)), t] for lp, t in res])
    ppl = math.exp(nll.mean())
    kl = np.concatenate([(np.exp(b[0]) * (b[0] - r[0])).sum(-1) for r, b in zip(res, base)]).mean()
    top1 = np.concatenate([(r[0].argmax(-1) == b[0].argmax(-1)) for r, b in zip(res, base)]).mean()
    return ppl, kl, top1

base = nll_chunks(None)
bp = score(base, base)[0]
print('base ppl %.3f' % bp, flush=True)
import json
configs = json.loads(sys.argv[2])
for cfg in configs:
    t0 = time.time()
    S = build(cfg)
    r = nll_chunks(make_hook(S, cfg))
    p, kl, t1 = score(r, base)
    print('%-70s ppl %.3f  d %+.2f%%  kl %.4f  top1 %.3f  (%.0fs)' % (json.dumps(cfg), p, 100*(p/bp-1), kl, t1, time.time()-t0), flush=True)
