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
Environment: KVPQ_LIB (default build/libkvpq.so) for tokenization, NCAL (calibration chunks of 2048
tokens, default 2), SIM_CACHE (directory caching tokens and calibration activations).
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
HD = had(64)

calib_text = open(os.path.join(ROOT, 'data', 'text', 'emma.txt')).read()
ev_text = open(os.path.join(ROOT, 'data', 'text', 'persuasion.txt')).read()
CTX = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
NCAL = int(os.environ.get('NCAL', '2')); NCH = 2
CACHE = os.environ.get('SIM_CACHE')
cf = os.path.join(CACHE, 'calib%d.npz' % NCAL) if CACHE else None
if cf and os.path.exists(cf):
    z = np.load(cf); CT, ET = list(z['CT']), list(z['ET'])
    K = [z['K%d' % l] for l in range(30)]; V = [z['V%d' % l] for l in range(30)]; Q = [z['Q%d' % l] for l in range(30)]
else:
    CT = kv.tokenize(calib_text[:200000 * max(1, NCAL // 2)], False)
    ET = kv.tokenize(ev_text, False)
    t0 = time.time()
    col = [[] for _ in range(30)]
    for c in range(NCAL):
        fwd(CT[c*2048:(c+1)*2048], collect=col)
    K = [np.concatenate([a for a, b, c in col[l]]) for l in range(30)]   # (N, Hk, hd)
    V = [np.concatenate([b for a, b, c in col[l]]) for l in range(30)]   # (N, Hk, hd)
    Q = [np.concatenate([c for a, b, c in col[l]]) for l in range(30)]   # (N, H, hd)
    print('calib fwd', time.time()-t0, K[0].shape, flush=True)
    if cf:
        os.makedirs(CACHE, exist_ok=True)
        np.savez(cf, CT=np.array(CT), ET=np.array(ET), **{'K%d' % l: K[l] for l in range(30)},
                 **{'V%d' % l: V[l] for l in range(30)}, **{'Q%d' % l: Q[l] for l in range(30)})
G = L.n_head // L.n_head_kv

def psd_pow(S, a):  # symmetric power of a PSD matrix
    w, U = np.linalg.eigh(S.astype(np.float64)); w = np.maximum(w, w.max() * 1e-8)
    return ((U * w**a) @ U.T).astype(np.float32)

def key_transform(cfg, l, k):  # k (N, Hk, hd) centred -> A (Hk, hd, hd), k' = A k per head (row vectors: k @ A^T)
    kt = cfg.get('kt', 'lam'); a = cfg.get('ka', 1.0)
    if not cfg.get('smooth', True): lam = np.ones(k.shape[1:], np.float32)
    elif cfg.get('lamq'): lam = np.maximum(np.sqrt(np.quantile(np.abs(k), cfg['lamq'], axis=0)), 1e-2).astype(np.float32)  # (Hk, hd)
    else: lam = np.maximum(np.sqrt(np.abs(k).max(0)), 1e-2)  # (Hk, hd)
    q = Q[l]  # (N, H, hd)
    A = np.empty((k.shape[1], 64, 64), np.float32)
    for h in range(k.shape[1]):
        qg = q[:, h*G:(h+1)*G].reshape(-1, 64).astype(np.float64)
        if kt == 'lam': A[h] = np.diag(1 / lam[h])
        elif kt == 'qrms': A[h] = np.diag(np.sqrt((qg**2).mean(0))**a)
        elif kt == 'qfull': A[h] = psd_pow(qg.T @ qg / len(qg), a / 2)
        elif kt == 'none': A[h] = np.eye(64)
        elif kt == 'kstd': A[h] = np.diag(np.sqrt((k[:, h].astype(np.float64)**2).mean(0))**-a)
        elif kt == 'kwhite': kh = k[:, h].astype(np.float64); A[h] = psd_pow(kh.T @ kh / len(kh), -a / 2)
        else: raise ValueError(kt)
        if kt != 'lam' and cfg.get('klam', 0): A[h] = A[h] * (lam[h] ** -cfg['klam'])[None, :]
    return A

def value_transform(cfg, l):  # -> B (Hk, hd, hd)
    B = np.empty((L.n_head_kv, 64, 64), np.float32)
    wo = L.w['blk.%d.attn_output.weight' % l]  # (n_embd, H*hd)
    for h in range(L.n_head_kv):
        if cfg.get('vt', 'none') == 'none': B[h] = np.eye(64); continue
        S = sum(wo[:, j*64:(j+1)*64].T.astype(np.float64) @ wo[:, j*64:(j+1)*64] for j in range(h*G, (h+1)*G))
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
    for c in range(N // 2048):
        sl = slice(c*2048, (c+1)*2048); i = np.arange(2048)
        far = (i[:, None] - i[None, :]) >= W
        for hh in range(q.shape[1]):
            s = q[sl, hh] @ k[sl, hh // G].T / 8.0
            s = np.where(i[:, None] >= i[None, :], s, -np.inf)
            p = np.exp(s - s.max(1, keepdims=True)); p /= p.sum(1, keepdims=True)
            out[sl, hh // G] += (p * far).sum(0)
        out[c*2048:c*2048+sink] = 0
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

def build(cfg):
    dsub, nbits, sub, vrot, perhead, kdsub = cfg['dsub'], cfg['nbits'], cfg.get('sub', False), cfg.get('vrot', False), cfg.get('perhead', False), cfg.get('kdsub', cfg['dsub'])
    S = []
    KITER[0] = cfg.get('kiter', 25)
    for l in range(30):
        if l in cfg.get('k4layers', []): kdsub = 2
        else: kdsub = cfg.get('kdsub', cfg['dsub'])
        if 'klayers' in cfg and l not in cfg['klayers'] and not cfg.get('qv', True): S.append(None); continue
        k = K[l]; v = V[l]
        if cfg.get('cbfile'):  # lambda, mu and codebooks from a kvpq codebook file (shared granularity)
            from safetensors.numpy import load_file
            from safetensors import safe_open
            if cfg['cbfile'] not in CBF: CBF[cfg['cbfile']] = load_file(cfg['cbfile'])
            with safe_open(cfg['cbfile'], framework='numpy') as f: meta = f.metadata()
            t = CBF[cfg['cbfile']]; lamc = t['layers.%d.k.smooth' % l]; mu = t['layers.%d.k.mean' % l]
            A = np.stack([np.diag(1 / lamc[h]) for h in range(3)]).astype(np.float32)
            Ai = np.stack([np.diag(lamc[h]) for h in range(3)]).astype(np.float32)
            I3 = np.stack([np.eye(64, dtype=np.float32)] * 3)
            kq = FixedPQ(t['layers.%d.k.codebook' % l], meta.get('k.norm') == '1')
            vq = FixedPQ(t['layers.%d.v.codebook' % l], meta.get('v.norm') == '1')
            S.append(((A, Ai, I3, I3, np.zeros((3, 64), np.float32)), kq, vq, mu, None)); continue
        mu = k.mean(0) if cfg.get('center') else np.zeros(k.shape[1:], np.float32)
        k = k - mu
        A = key_transform(cfg, l, k); B = value_transform(cfg, l)
        Ai = np.linalg.inv(A.astype(np.float64)).astype(np.float32); Bi = np.linalg.inv(B.astype(np.float64)).astype(np.float32)
        kt = np.einsum('nhd,hed->nhe', k, A)
        kt = kt @ HD.T if cfg.get('rot', True) else kt
        muv = v.mean(0) if cfg.get('vcenter') else np.zeros(v.shape[1:], np.float32)
        vt = np.einsum('nhd,hed->nhe', v - muv, B)
        vt = vt @ HD.T if vrot else vt
        lam = (A, Ai, B, Bi, muv)
        if perhead:
            kq = [mkpq(kt[:, h], kdsub, nbits, sub, cfg, 'k') for h in range(3)]; vq = [mkpq(vt[:, h], cfg.get('vdsub', dsub), cfg.get('vnbits', nbits), sub, cfg, 'v') for h in range(3)]
        else:
            kw = None
            if cfg.get('kw'):
                kw = attn_received(l) ** cfg['kw']; kw = (kw / kw.mean() + cfg.get('kw0', 0.0)).reshape(-1)
            kq = mkpq(kt.reshape(-1, 64), kdsub, nbits, sub, cfg, 'k', kw); vq = mkpq(vt.reshape(-1, 64), cfg.get('vdsub', dsub), cfg.get('vnbits', nbits), sub, cfg, 'v')
        kthr = None
        if cfg.get('kout') and not perhead:  # error threshold: keys above it stay exact (dense-and-sparse)
            xs = kt.reshape(-1, 64)[::4]
            kthr = np.quantile(((xs - kq.rec(xs))**2).sum(1), 1 - cfg['kout'])
        S.append((lam, kq, vq, mu, kthr))
    return S

def make_hook(S, cfg):
    sink = cfg.get('sink', 0); W = cfg.get('window', 128); vrot = cfg.get('vrot', False); perhead = cfg.get('perhead', False)
    qk = cfg.get('qk', True); qv = cfg.get('qv', True)
    def hook(l, k, v):
        if S[l] is None: return k, v
        (A, Ai, B, Bi, muv), kq, vq, mu, kthr = S[l]; n = k.shape[0]
        lo, hi = sink, max(sink, n - W)
        if hi <= lo: return k, v
        k = k.copy(); v = v.copy()
        kt = np.einsum('nhd,hed->nhe', k[lo:hi] - mu, A)
        kt = kt @ HD.T if cfg.get('rot', True) else kt
        vt = np.einsum('nhd,hed->nhe', v[lo:hi] - muv, B)
        vt = vt @ HD.T if vrot else vt
        if perhead:
            kr = np.stack([kq[h].rec(kt[:, h]) for h in range(3)], 1); vr = np.stack([vq[h].rec(vt[:, h]) for h in range(3)], 1)
        else:
            kr = kq.rec(kt.reshape(-1, 64)).reshape(kt.shape); vr = vq.rec(vt.reshape(-1, 64)).reshape(vt.shape)
        if kthr is not None:  # outlier keys (reconstruction error above the calibrated threshold) stay exact
            keep = ((kt - kr)**2).sum(-1) > kthr  # (n, Hk)
            kr = np.where(keep[..., None], kt, kr)
        kr = (kr @ HD) if cfg.get('rot', True) else kr
        vr = (vr @ HD) if vrot else vr
        if qk and ('klayers' not in cfg or l in cfg['klayers']): k[lo:hi] = np.einsum('nhd,hed->nhe', kr, Ai) + mu
        if qv: v[lo:hi] = np.einsum('nhd,hed->nhe', vr, Bi) + muv
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
