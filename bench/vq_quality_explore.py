#!/usr/bin/env python3
"""Explore what limits VQ cache quality, with an independent numpy simulation of the pipeline.

Runs the numpy Llama forward pass of bench/llama_cpp_peer.py (weights dequantized by the PyPI
`gguf` package) on SmolLM2 (or MODEL: Llama-family, Qwen2), collects post-RoPE keys, values and
queries on the calibration novel, trains
codebooks with faiss k-means, and re-runs the held-out novel with the keys and values replaced by
their PQ reconstructions (all positions except the newest `window`), as the VQ cache attends them.
Prints perplexity, change against the unquantized run, KL and top-1 agreement per configuration.

usage: bench/vq_quality_explore.py CTX '[{"dsub":4,"nbits":8}, {"dsub":4,"nbits":8,"center":true}]'
config keys: dsub, nbits, sub (per-sub-space codebooks), vrot (rotate values), perhead (codebook per
KV head), smooth (default true), rot (default true), center (subtract the per-channel key mean),
sink (first tokens kept exact), window (default 128), qk / qv (quantize keys / values, default true),
kdsub (key dsub when it differs from dsub), vdsub / vnbits (value dsub / nbits when they differ),
kt: key transform A in k' = H A (k - mu): "lam" (default, A = diag(1/lambda)), "qrms" (A = diag(q_rms^ka),
  q_rms = per-channel RMS of the post-RoPE queries of the KV head's GQA group on the calibration text),
  "qfull" (A = Sigma_q^(ka/2), Sigma_q = pooled query second-moment matrix per layer and KV head);
  "none" (A = I), "kstd" (A = diag(std_k^-ka)), "kwhite" (A = Cov_k^(-ka/2), key whitening);
  ka (default 1), klam (extra factor diag(lambda^-klam) after A for kt != lam, default 0),
vt: value transform B in v' = H B v: "none" (default), "wo" (B = (sum_h W_o,h^T W_o,h)^(va/2) over the
  group's query heads), va (default 1); vrot applies the Hadamard H to values; vcenter subtracts the
  per-(KV head, channel) value mean before B (added back after decoding),
klayers (list: quantize keys only in these layers), k4layers (list: these layers use key dsub 2),
lamq (lambda = sqrt of this quantile of |K - mu| per channel instead of the max),
kneq / vneq (norm-explicit: PQ of the direction plus a float16 least-squares scale per vector),
kout (fraction: keys whose reconstruction error exceeds the calibration quantile 1 - kout stay exact),
krq / vrq (residual stages: S stages of PQ with dsub * S dims each, same bits),
cbfile (evaluate the smoothing factors, key means and shared codebooks of a kvpq codebook file
  instead of training; values unrotated), kiter (k-means iterations, default 25), kw (weight each calibration key in the key k-means by
  (attention it receives from queries >= 128 positions later)^kw, first 4 tokens of a chunk weight 0;
  kw0 is added to the normalized weights).
Predictive coding (issue 30; no extra bits per element, the predictors are per layer):
prerope (keys coded before RoPE: un-rotated by -position, coded, rotated back at the key's position;
  KVQuant, arXiv 2401.18079), ilp ("k", "v" or "kv": code layer l's keys / values minus a
  least-squares linear prediction, with intercept, from layer l-1's RECONSTRUCTION, all its KV heads;
  fitted on the calibration text's reconstructions, layer by layer), delta ("k", "v" or "kv": code
  x_t - m - a (xhat_{t-1} - m), a per-(KV head, channel) AR(1) on the previous token's reconstruction,
  closed loop as DPCM; after ilp when both are on). Centering is implied by ilp (the intercept).
  ilpanchor N: layers l with l % N == 0 are coded without prediction (chains at most N - 1 deep);
  ilphead: head h predicted from head h of the previous layer only (block-diagonal W);
  ropealign: prerope without the Hadamard, lambda tied over each RoPE pair and the pairs' channels
  made adjacent, so each sub-space holds whole RoPE pairs (implies prerope, rot false).
Environment: KVPQ_LIB (default build/libkvpq.so) for tokenization, MODEL (GGUF, default SmolLM2;
Llama-family or Qwen2), NCAL (calibration chunks, default 2) of CAL_CTX tokens (default 2048), NCH
(evaluation chunks of CTX tokens, default 2), SIM_CACHE (directory caching tokens and calibration
activations), PROXY=1 (no perplexity: per-layer score error, attention KL and attention-output error
on the exact activations of the first held-out chunk, means over layers and query heads).
"""
import os
import sys, math, time
import numpy as np
import faiss
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'bench'))
from llama_cpp_peer import NumpyLlama
M = os.environ.get('MODEL', os.path.join(ROOT, 'models', 'SmolLM2-135M-Instruct.Q4_1.gguf'))
np.random.seed(0)
L = NumpyLlama(M)
NL, HK, HDIM = L.n_layer, L.n_head_kv, L.head_dim
# tokenize with kvpq (the Python package, through llama_cpp_peer.Kvpq)
from llama_cpp_peer import Kvpq
kv = Kvpq(os.environ.get('KVPQ_LIB', os.path.join(ROOT, 'build', 'libkvpq.so')), M, 2)

def fwd(tokens, hook=None, collect=None):
    """NumpyLlama.forward; collect (per-layer lists) gets (k, v, q) of each layer."""
    flat = [] if collect is not None else None
    logits = L.forward(tokens, collect=flat, hook=hook)
    for l, kvq in enumerate(flat or []):
        collect[l].append(kvq)
    return logits

def had(d):
    Hm = np.array([[1.0]])
    while Hm.shape[0] < d: Hm = np.block([[Hm, Hm], [Hm, -Hm]])
    return (Hm / math.sqrt(d)).astype(np.float32)
HD = had(HDIM)

calib_text = open(os.path.join(ROOT, 'data', 'text', 'emma.txt')).read()
ev_text = open(os.path.join(ROOT, 'data', 'text', 'persuasion.txt')).read()
CTX = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
NCAL = int(os.environ.get('NCAL', '2')); NCH = int(os.environ.get('NCH', '2'))
CAL = int(os.environ.get('CAL_CTX', '2048'))  # tokens per calibration chunk (positions restart at 0)
CACHE = os.environ.get('SIM_CACHE')
TAG = '' if M.endswith('SmolLM2-135M-Instruct.Q4_1.gguf') else '_' + os.path.basename(M).split('.')[0]
cf = os.path.join(CACHE, 'calib%d%s%s.npz' % (NCAL, '' if CAL == 2048 else '_c%d' % CAL, TAG)) if CACHE else None
if cf and os.path.exists(cf):
    z = np.load(cf); CT, ET = list(z['CT']), list(z['ET'])
    K = [z['K%d' % l] for l in range(NL)]; V = [z['V%d' % l] for l in range(NL)]; Q = [z['Q%d' % l] for l in range(NL)]
else:
    CT = kv.tokenize(calib_text[:200000 * max(1, NCAL // 2)], False)
    ET = kv.tokenize(ev_text, False)
    t0 = time.time()
    col = [[] for _ in range(NL)]
    for c in range(NCAL):
        fwd(CT[c*CAL:(c+1)*CAL], collect=col)
    K = [np.concatenate([a for a, b, c in col[l]]) for l in range(NL)]   # (N, Hk, hd)
    V = [np.concatenate([b for a, b, c in col[l]]) for l in range(NL)]   # (N, Hk, hd)
    Q = [np.concatenate([c for a, b, c in col[l]]) for l in range(NL)]   # (N, H, hd)
    print('calib fwd', time.time()-t0, K[0].shape, flush=True)
    if cf:
        os.makedirs(CACHE, exist_ok=True)
        np.savez(cf, CT=np.array(CT), ET=np.array(ET), **{'K%d' % l: K[l] for l in range(NL)},
                 **{'V%d' % l: V[l] for l in range(NL)}, **{'Q%d' % l: Q[l] for l in range(NL)})
G = L.n_head // L.n_head_kv

def psd_pow(S, a):  # symmetric power of a PSD matrix
    w, U = np.linalg.eigh(S.astype(np.float64)); w = np.maximum(w, w.max() * 1e-8)
    return ((U * w**a) @ U.T).astype(np.float32)

def key_transform(cfg, l, k):  # k (N, Hk, hd) centred -> A (Hk, hd, hd), k' = A k per head (row vectors: k @ A^T)
    kt = cfg.get('kt', 'lam'); a = cfg.get('ka', 1.0)
    if not cfg.get('smooth', True): lam = np.ones(k.shape[1:], np.float32)
    elif cfg.get('lamq'): lam = np.maximum(np.sqrt(np.quantile(np.abs(k), cfg['lamq'], axis=0)), 1e-2).astype(np.float32)  # (Hk, hd)
    else: lam = np.maximum(np.sqrt(np.abs(k).max(0)), 1e-2)  # (Hk, hd)
    if cfg.get('ropealign'): return rope_pair_transform(lam)
    q = Q[l]  # (N, H, hd)
    A = np.empty((k.shape[1], HDIM, HDIM), np.float32)
    for h in range(k.shape[1]):
        qg = q[:, h*G:(h+1)*G].reshape(-1, HDIM).astype(np.float64)
        if kt == 'lam': A[h] = np.diag(1 / lam[h])
        elif kt == 'qrms': A[h] = np.diag(np.sqrt((qg**2).mean(0))**a)
        elif kt == 'qfull': A[h] = psd_pow(qg.T @ qg / len(qg), a / 2)
        elif kt == 'none': A[h] = np.eye(HDIM)
        elif kt == 'kstd': A[h] = np.diag(np.sqrt((k[:, h].astype(np.float64)**2).mean(0))**-a)
        elif kt == 'kwhite': kh = k[:, h].astype(np.float64); A[h] = psd_pow(kh.T @ kh / len(kh), -a / 2)
        else: raise ValueError(kt)
        if kt != 'lam' and cfg.get('klam', 0): A[h] = A[h] * (lam[h] ** -cfg['klam'])[None, :]
    return A

def rope_pair_transform(lam):
    """`ropealign` (keys before RoPE, no Hadamard): A = P diag(1/lambda') with lambda' tied over each
    RoPE pair (the larger of the two) and P putting each pair's two channels next to each other, so
    that every PQ sub-space (even dsub) holds whole pairs and a 2-D rotation by the key's position
    commutes with A: the layout attention from codes needs to apply RoPE per sub-space."""
    half = L.n_rot // 2
    pair = (np.arange(half), np.arange(half) + half) if L.neox else (np.arange(0, L.n_rot, 2), np.arange(1, L.n_rot, 2))
    lam = lam.copy(); m = np.maximum(lam[:, pair[0]], lam[:, pair[1]]); lam[:, pair[0]] = m; lam[:, pair[1]] = m
    order = np.stack(pair, 1).reshape(-1)  # channel order: pair 0's two channels, pair 1's, ...
    P = np.eye(HDIM, dtype=np.float32)[order]
    return np.stack([P @ np.diag(1 / lam[h]) for h in range(len(lam))]).astype(np.float32)

def value_transform(cfg, l):  # -> B (Hk, hd, hd)
    B = np.empty((L.n_head_kv, HDIM, HDIM), np.float32)
    wo = L.w['blk.%d.attn_output.weight' % l]  # (n_embd, H*hd)
    for h in range(L.n_head_kv):
        if cfg.get('vt', 'none') == 'none': B[h] = np.eye(HDIM); continue
        S = sum(wo[:, j*HDIM:(j+1)*HDIM].T.astype(np.float64) @ wo[:, j*HDIM:(j+1)*HDIM] for j in range(h*G, (h+1)*G))
        B[h] = psd_pow(S, cfg.get('va', 1.0) / 2)
    return B

KITER = [25]
CBF = {}  # path -> tensors of the codebook files of cbfile configs
def kmeans(x, k, niter=None, w=None):
    niter = niter or KITER[0]
    km = faiss.Kmeans(x.shape[1], k, niter=niter, seed=1, max_points_per_centroid=256)
    km.train(np.ascontiguousarray(x, dtype=np.float32), weights=None if w is None else np.ascontiguousarray(w, dtype=np.float32)); return km

def attn_received(l, W=128, sink=4):  # (N, Hk): attention mass each calibration key gets from queries >= W later
    q, k = Q[l], K[l]; N = k.shape[0]; out = np.zeros((N, k.shape[1]))
    for c in range(N // CAL):
        sl = slice(c*CAL, (c+1)*CAL); i = np.arange(CAL)
        far = (i[:, None] - i[None, :]) >= W
        for hh in range(q.shape[1]):
            s = q[sl, hh] @ k[sl, hh // G].T / math.sqrt(HDIM)
            s = np.where(i[:, None] >= i[None, :], s, -np.inf)
            p = np.exp(s - s.max(1, keepdims=True)); p /= p.sum(1, keepdims=True)
            out[sl, hh // G] += (p * far).sum(0)
        out[c*CAL:c*CAL+sink] = 0
    return out

class PQN:
    """Norm-explicit PQ (Dai et al., AAAI 2020): PQ of the direction x/|x|, plus one per-vector scale
    s = x.r/|r|^2 (least squares, r = reconstruction of the direction), stored as float16.
    With stages > 1, residual PQ of the direction (each stage dsub * stages dims, same bits)."""
    def __init__(self, X, dsub, nbits, sub, w=None, stages=1, scale=True):
        self.scale = scale
        U = X / np.maximum(np.linalg.norm(X, axis=1, keepdims=True), 1e-12) if scale else X
        self.st = []
        R = U.copy()
        for i in range(stages):
            pq = PQ(R, dsub * stages, nbits, sub, w); self.st.append(pq); R = R - pq.rec(R)
    def rec(self, X):
        U = X / np.maximum(np.linalg.norm(X, axis=1, keepdims=True), 1e-12) if self.scale else X
        out = np.zeros_like(X); R = U.copy()
        for pq in self.st:
            r = pq.rec(R); out += r; R = R - r
        if not self.scale: return out
        sc = (X * out).sum(1) / np.maximum((out * out).sum(1), 1e-20)
        return out * sc.astype(np.float16).astype(np.float32)[:, None]

class FixedPQ:
    """A shared-codebook PQ with given centroids (ksub, dsub), e.g. read from a kvpq codebook file;
    norm: code directions and keep a float16 least-squares scale per vector, as the VQ cache does."""
    def __init__(self, cent, norm):
        self.c = np.ascontiguousarray(cent, dtype=np.float32); self.dsub = cent.shape[1]; self.norm = norm
        self.index = faiss.IndexFlatL2(self.dsub); self.index.add(self.c)
    def rec(self, X):
        n, d = X.shape
        U = X / np.maximum(np.linalg.norm(X, axis=1, keepdims=True), 1e-12) if self.norm else X
        _, I = self.index.search(np.ascontiguousarray(U.reshape(-1, self.dsub)), 1)
        r = self.c[I[:, 0]].reshape(n, d)
        if not self.norm: return r
        sc = (X * r).sum(1) / np.maximum((r * r).sum(1), 1e-20)
        return r * sc.astype(np.float16).astype(np.float32)[:, None]

def mkpq(X, dsub, nbits, sub, cfg, which, w=None):
    st = cfg.get(which + 'rq', 1); sc = cfg.get(which + 'neq', False)
    if st == 1 and not sc: return PQ(X, dsub, nbits, sub, w)
    return PQN(X, dsub, nbits, sub, w, st, sc)

class PQ:
    def __init__(self, X, dsub, nbits, sub, w=None):  # X (N, d), w (N,) k-means weights
        self.dsub = dsub; self.sub = sub; d = X.shape[1]; self.M = d // dsub
        if sub:
            self.km = [kmeans(X[:, m*dsub:(m+1)*dsub], 2**nbits) for m in range(self.M)]
        else:
            self.km = kmeans(X.reshape(-1, dsub), 2**nbits, w=None if w is None else np.repeat(w, self.M))
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

# ---- predictive coding: keys before RoPE, inter-layer prediction, per-token deltas (issue 30) ----

POS_CAL = np.arange(len(K[0])) % CAL  # position of each calibration row (chunks restart at 0)
KPRE = {}  # layer -> calibration keys before RoPE, (N, Hk, hd)

def key_domain(cfg, l):
    """Calibration keys in the domain they are coded in: post-RoPE, or before RoPE (`prerope`,
    KVQuant, arXiv 2401.18079, sec. 3.2): RoPE undone exactly by rotating back by -position."""
    if not (cfg.get('prerope') or cfg.get('ropealign')): return K[l]
    if l not in KPRE: KPRE[l] = L.rope(K[l], -POS_CAL.astype(np.float64))
    return KPRE[l]

def lstsq(X, Y, ridge=1e-3):  # argmin_W |[X 1] W - Y|^2 + ridge-regularization, W (dx + 1, dy)
    X = np.concatenate([X, np.ones((len(X), 1))], 1).astype(np.float64)
    G_ = X.T @ X; G_ += ridge * np.trace(G_) / len(G_) * np.eye(len(G_))
    return np.linalg.solve(G_, X.T @ Y.astype(np.float64)).astype(np.float32)

def fit_ilp(prev, x, head=False):
    """Least-squares linear prediction (with intercept) of x (N, Hk, hd) from the previous layer's
    reconstruction prev (N, Hk, hd): W (Hk*hd + 1, Hk*hd), from all of its KV heads, or (`ilphead`)
    block-diagonal, head h from head h only."""
    n = len(x)
    if not head: return lstsq(prev.reshape(n, -1), x.reshape(n, -1))
    W = np.zeros((HK * HDIM + 1, HK * HDIM), np.float32)
    for h in range(HK):
        Wh = lstsq(prev[:, h], x[:, h]); s = slice(h * HDIM, (h + 1) * HDIM)
        W[s, s] = Wh[:-1]; W[-1, s] = Wh[-1]
    return W

def ilp_pred(W, prev):  # prev (n, Hk, hd) -> prediction (n, Hk, hd)
    n = len(prev)
    return (prev.reshape(n, -1) @ W[:-1] + W[-1]).reshape(prev.shape)

def fit_ar(r):
    """Per-(KV head, channel) AR(1) around the mean, r_t - m = a (r_{t-1} - m) + e_t, least squares
    over consecutive calibration positions of the same chunk. Returns m, a (Hk, hd) and e (N, Hk, hd),
    the open-loop innovations (the first position of each chunk: r_0 - m)."""
    m = r.mean(0); c = r - m
    same = POS_CAL[1:] > 0  # pairs (t-1, t) inside one chunk
    x0, x1 = c[:-1][same].astype(np.float64), c[1:][same].astype(np.float64)
    a = ((x0 * x1).sum(0) / np.maximum((x0 * x0).sum(0), 1e-20)).astype(np.float32)
    e = c.copy(); e[1:][same] = c[1:][same] - a * c[:-1][same]
    return m, a, e

class Coder:
    """Codes one layer's keys or values x (n, Hk, hd), in their coding domain:
    p = inter-layer prediction from the previous layer's reconstruction (W; 0 without `ilp`),
    r = x - p; with `delta` the innovation e_t = (r_t - m) - a (rhat_{t-1} - m) from the previous
    token's reconstruction (closed loop, DPCM: the decoder has rhat_{t-1}, so errors do not drift),
    else e = r; then y = H T (e - mu) (T = A or B, H = Hadamard when rot), PQ of y."""
    def __init__(self, mu, T, rot, pq, perhead=False, thr=None, W=None, ar=None):
        self.mu, self.T, self.rot, self.pq, self.perhead, self.thr, self.W = mu, T, rot, pq, perhead, thr, W
        self.Ti = np.linalg.inv(T.astype(np.float64)).astype(np.float32)
        self.m, self.a = ar if ar is not None else (None, None)
    def fwd(self, e):  # (n, Hk, hd) innovation -> transformed
        y = np.einsum('nhd,hed->nhe', e - self.mu, self.T)
        return y @ HD.T if self.rot else y
    def inv(self, y):
        y = y @ HD if self.rot else y
        return np.einsum('nhd,hed->nhe', y, self.Ti) + self.mu
    def quant(self, y):  # PQ reconstruction of transformed vectors (n, Hk, hd)
        if self.perhead: yr = np.stack([self.pq[h].rec(y[:, h]) for h in range(y.shape[1])], 1)
        else: yr = self.pq.rec(y.reshape(-1, HDIM)).reshape(y.shape)
        if self.thr is not None:  # outliers (reconstruction error above the calibrated threshold) stay exact
            yr = np.where((((y - yr)**2).sum(-1) > self.thr)[..., None], y, yr)
        return yr
    def code(self, x, prev, lo, hi):
        """Reconstruction of x[lo:hi]; x (n, Hk, hd) exact; prev (n, Hk, hd) what the decoder has of the
        previous layer (reconstruction in [lo, hi), exact elsewhere) or None."""
        p = ilp_pred(self.W, prev) if self.W is not None else np.zeros_like(x)
        r = x - p
        if self.a is None: return p[lo:hi] + self.inv(self.quant(self.fwd(r[lo:hi])))
        out = np.empty_like(r[lo:hi]); last = r[lo - 1] if lo > 0 else self.m  # exact sink / or the mean
        for t in range(lo, hi):
            guess = self.m + self.a * (last - self.m)
            last = guess + self.inv(self.quant(self.fwd((r[t] - guess)[None])))[0]
            out[t - lo] = last
        return p[lo:hi] + out

def calib_rec(cd, x, prev):
    """The coder's reconstruction of calibration rows x (N, Hk, hd), chunk by chunk (what the next
    layer's inter-layer predictor is fitted on: the decoder only has the reconstruction)."""
    return np.concatenate([cd.code(x[c:c+CAL], None if prev is None else prev[c:c+CAL], 0, CAL)
                           for c in range(0, len(x), CAL)])

def train_coder(cfg, kind, l, x, prev, T_of, rot, dsub, nbits, perhead, w=None):
    """Fit the predictors (ilp, delta) of one layer's keys (kind 'k') or values ('v') on calibration
    rows x, then the transform T_of(residual) and the PQ on the innovations."""
    anchor = l % cfg.get('ilpanchor', NL) == 0  # anchors: coded without prediction (bounds the chain)
    W = fit_ilp(prev, x, cfg.get('ilphead')) if kind in cfg.get('ilp', '') and prev is not None and not anchor else None
    e = x - ilp_pred(W, prev) if W is not None else x
    ar = None
    if kind in cfg.get('delta', ''): m, a, e = fit_ar(e); ar = (m, a)
    center = cfg.get('center') if kind == 'k' else cfg.get('vcenter')
    mu = e.mean(0) if center or W is not None else np.zeros(e.shape[1:], np.float32)
    T = T_of(e - mu)
    y = np.einsum('nhd,hed->nhe', e - mu, T); y = y @ HD.T if rot else y
    sub = cfg.get('sub', False)
    if perhead: pq = [mkpq(y[:, h], dsub, nbits, sub, cfg, kind) for h in range(y.shape[1])]
    else: pq = mkpq(y.reshape(-1, HDIM), dsub, nbits, sub, cfg, kind, w)
    thr = None
    if kind == 'k' and cfg.get('kout') and not perhead:  # error threshold: keys above it stay exact (dense-and-sparse)
        xs = y.reshape(-1, HDIM)[::4]
        thr = np.quantile(((xs - pq.rec(xs))**2).sum(1), 1 - cfg['kout'])
    cd = Coder(mu, T, rot, pq, perhead, thr, W, ar)
    cd.gain = float(((e - e.mean(0))**2).sum() / ((x - x.mean(0))**2).sum())  # innovation / centered variance
    return cd

def cbfile_coders(cfg, l):
    """Key and value coders from a kvpq codebook file's lambda, key means and shared codebooks."""
    from safetensors.numpy import load_file
    from safetensors import safe_open
    if cfg['cbfile'] not in CBF: CBF[cfg['cbfile']] = load_file(cfg['cbfile'])
    with safe_open(cfg['cbfile'], framework='numpy') as f: meta = f.metadata()
    t = CBF[cfg['cbfile']]; lamc = t['layers.%d.k.smooth' % l]
    A = np.stack([np.diag(1 / lamc[h]) for h in range(HK)]).astype(np.float32)
    I = np.stack([np.eye(HDIM, dtype=np.float32)] * HK)
    kq = FixedPQ(t['layers.%d.k.codebook' % l], meta.get('k.norm') == '1')
    vq = FixedPQ(t['layers.%d.v.codebook' % l], meta.get('v.norm') == '1')
    return Coder(t['layers.%d.k.mean' % l], A, True, kq), Coder(np.zeros((HK, HDIM), np.float32), I, False, vq)

def build(cfg):
    """Per layer: (key coder, value coder), or None for a layer left exact."""
    if cfg.get('ropealign'): cfg = dict(cfg, prerope=True, rot=False)
    dsub, nbits, perhead = cfg['dsub'], cfg['nbits'], cfg.get('perhead', False)
    S = []; prev = {'k': None, 'v': None}
    KITER[0] = cfg.get('kiter', 25)
    for l in range(NL):
        kdsub = 2 if l in cfg.get('k4layers', []) else cfg.get('kdsub', dsub)
        if 'klayers' in cfg and l not in cfg['klayers'] and not cfg.get('qv', True):
            S.append(None); prev = {'k': None, 'v': None}; continue
        if cfg.get('cbfile'): S.append(cbfile_coders(cfg, l)); continue
        x = {'k': key_domain(cfg, l), 'v': V[l]}
        kw = None
        if cfg.get('kw'):
            kw = attn_received(l) ** cfg['kw']; kw = (kw / kw.mean() + cfg.get('kw0', 0.0)).reshape(-1)
        kc = train_coder(cfg, 'k', l, x['k'], prev['k'], lambda e: key_transform(cfg, l, e), cfg.get('rot', True),
                         kdsub, nbits, perhead, kw)
        vc = train_coder(cfg, 'v', l, x['v'], prev['v'], lambda e: value_transform(cfg, l), cfg.get('vrot', False),
                         cfg.get('vdsub', dsub), cfg.get('vnbits', nbits), perhead)
        for kind, cd in (('k', kc), ('v', vc)):  # the next layer predicts from this layer's reconstruction
            if kind in cfg.get('ilp', ''): prev[kind] = calib_rec(cd, x[kind], prev[kind])
        S.append((kc, vc))
    return S

def make_hook(S, cfg):
    """hook(l, k, v) for NumpyLlama.forward: every position in [sink, n - window) replaced by its
    reconstruction; keeps what the decoder has of the previous layer for inter-layer prediction."""
    sink = cfg.get('sink', 0); W = cfg.get('window', 128)
    qk = cfg.get('qk', True); qv = cfg.get('qv', True); pre = cfg.get('prerope') or cfg.get('ropealign')
    prev = {}
    def hook(l, k, v):
        if S[l] is None: prev.clear(); return k, v
        n = k.shape[0]; lo, hi = sink, max(sink, n - W)
        if hi <= lo: return k, v
        pos = np.arange(n, dtype=np.float64)
        x = {'k': L.rope(k, -pos) if pre else k.copy(), 'v': v.copy()}
        on = {'k': qk and ('klayers' not in cfg or l in cfg['klayers']), 'v': qv}
        for kind, cd in zip('kv', S[l]):
            if on[kind]: x[kind][lo:hi] = cd.code(x[kind], prev.get(kind), lo, hi)
            prev[kind] = x[kind]
        return (L.rope(x['k'], pos) if pre else x['k']), x['v']
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

# ---- cheap proxy (PROXY=1): per-layer attention error on the exact activations of one held-out chunk ----

def proxy(S, cfg, ev):
    """Each layer's K/V coded as the hook codes them (the previous layer's reconstruction feeds the
    inter-layer predictor), on exact activations ev (per layer (k, v, q)) of one held-out chunk.
    Returns the means over layers of: relative score error E[(q.(k^ - k))^2] / E[(q.k)^2] over causal
    pairs, attention KL(p || p^) and relative attention-output error |o^ - o|^2 / |o|^2 over the
    second half's queries."""
    hook = make_hook(S, cfg); se, kls, oe = [], [], []
    for l, (k, v, q) in enumerate(ev):
        kr, vr = hook(l, k, v); n = len(k); i = np.arange(n); causal = i[:, None] >= i[None, :]
        qs = q[n // 2:]
        for hh in range(q.shape[1]):
            h = hh // G
            s = qs[:, hh] @ k[:, h].T / math.sqrt(HDIM); sr = qs[:, hh] @ kr[:, h].T / math.sqrt(HDIM)
            c = causal[n // 2:]
            se.append(((s - sr)[c]**2).mean() / (s[c]**2).mean())
            s = np.where(c, s, -np.inf); sr = np.where(c, sr, -np.inf)
            lp = s - s.max(1, keepdims=True); lp -= np.log(np.exp(lp).sum(1, keepdims=True))
            lr = sr - sr.max(1, keepdims=True); lr -= np.log(np.exp(lr).sum(1, keepdims=True))
            p = np.exp(lp); kls.append((p * np.where(c, lp - lr, 0)).sum(1).mean())
            o = p @ v[:, h]; orr = np.exp(lr) @ vr[:, h]
            oe.append(((o - orr)**2).sum() / (o**2).sum())
    return np.mean(se), np.mean(kls), np.mean(oe)

import json
configs = json.loads(sys.argv[2])
if os.environ.get('PROXY'):
    ev = [[] for _ in range(NL)]; fwd(ET[:CTX], collect=ev); ev = [e[0] for e in ev]
    for cfg in configs:
        t0 = time.time(); S = build(cfg); se, kl, oe = proxy(S, cfg, ev)
        gk, gv = (np.mean([getattr(s[i], 'gain', 1.0) for s in S if s]) for i in (0, 1))
        print('%-70s score err %.4f  attn KL %.4f  out err %.4f  innov/var K %.3f V %.3f  (%.0fs)'
              % (json.dumps(cfg), se, kl, oe, gk, gv, time.time()-t0), flush=True)
    sys.exit(0)
base = nll_chunks(None)
bp = score(base, base)[0]
print('base ppl %.3f' % bp, flush=True)
for cfg in configs:
    t0 = time.time()
    S = build(cfg)
    r = nll_chunks(make_hook(S, cfg))
    p, kl, t1 = score(r, base)
    print('%-70s ppl %.3f  d %+.2f%%  kl %.4f  top1 %.3f  (%.0fs)' % (json.dumps(cfg), p, 100*(p/bp-1), kl, t1, time.time()-t0), flush=True)
