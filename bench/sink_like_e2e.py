#!/usr/bin/env python3
"""End-to-end simulation on SmolLM2 (transformers, float32): every layer's keys and values replaced by
their d4b8 norm-explicit PQ reconstruction (query-aware smoothing for keys, as kvpq calibrate), position 0
exact (1 sink), and optionally 'sink-like' positions exact: cos(k_j - mu, k_0 - mu) >= tau[l, h], tau the
(1 - F) quantile on the calibration text. KL(exact || sim) and ppl over positions 1024..2047 of persuasion.

Results and conclusion: docs/vq_quality.md, "Sink-like positions" (session 11). Needs the activations
bench/smooth_study.py captures (out/smooth_study/cal_L*.npz), torch, transformers, gguf, the kvpq package.
Usage: KVPQ_LIB=build/libkvpq.so python3 bench/sink_like_e2e.py"""
import os, sys, numpy as np, torch
from pathlib import Path
SRC = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(SRC / "python")); sys.path.insert(0, str(SRC / "bench"))
os.environ.setdefault("KVPQ_LIB", str(SRC / "build" / "libkvpq.so"))
import kvpq
from smooth_study import transforms, code_norm_explicit
from pathlib import Path
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
work = str(SRC / "out" / "smooth_study")
md, mf = str(SRC / "models"), "SmolLM2-135M-Instruct.Q4_1.gguf"
tok = AutoTokenizer.from_pretrained(md, gguf_file=mf)
model = AutoModelForCausalLM.from_pretrained(md, gguf_file=mf, dtype=torch.float32)
ids = tok((SRC / "data" / "text" / "persuasion.txt").read_text(encoding="utf-8")[:400000], return_tensors="pt").input_ids[:, :2048]
L = 30
H = kvpq.hadamard(np.eye(64, dtype=np.float32)).astype(np.float64)
prep = []
for l in range(L):
    c = np.load(f"{work}/cal_L{l}.npz")
    qc, kc, vc = (c[x].astype(np.float64) for x in "qkv")
    f, finv = transforms("query", qc, kc, H)
    mu = kc.mean(0)
    kcen = kc - mu
    cos = np.einsum("nhd,hd->nh", kcen[1:], kcen[0]) / np.maximum(np.linalg.norm(kcen[1:], axis=-1) * np.linalg.norm(kcen[0], axis=-1), 1e-30)
    prep.append(dict(qc=qc, kc=kc, vc=vc, f=f, finv=finv, mu=mu, cos=cos))
cfg = {}
def sim(module, q, k, v, mask, **kw):
    l = module.layer_idx
    if cfg.get("exact"):
        return sdpa_attention_forward(module, q, k, v, mask, **kw)
    P = prep[l]
    kt = k[0].transpose(0, 1).numpy().astype(np.float64)  # (T, hkv, d)
    vt = v[0].transpose(0, 1).numpy().astype(np.float64)
    kh = P["finv"](code_norm_explicit(kvpq, P["f"](P["kc"]), P["f"](kt), cfg["kp"])) if cfg["kp"] else kt.copy()
    vh = code_norm_explicit(kvpq, P["vc"], vt, cfg["vp"]) if cfg["vp"] else vt.copy()
    ex = np.zeros(kt.shape[:2], bool); ex[0] = True
    F = cfg.get("frac", 0)
    if F > 0 and l in cfg.get("layers", range(L)):
        tau = np.quantile(P["cos"], 1 - F, axis=0)  # (hkv)
        kcen = kt - P["mu"]
        cos = np.einsum("nhd,hd->nh", kcen, kcen[0]) / np.maximum(np.linalg.norm(kcen, axis=-1) * np.linalg.norm(kcen[0], axis=-1), 1e-30)
        ex |= cos >= tau[None, :]
        cfg["nex"] = cfg.get("nex", 0) + ex.sum() - ex.shape[1]; cfg["ntot"] = cfg.get("ntot", 0) + ex.size
    kh[ex] = kt[ex]; vh[ex] = vt[ex]
    k2 = torch.from_numpy(kh.astype(np.float32)).transpose(0, 1)[None]
    v2 = torch.from_numpy(vh.astype(np.float32)).transpose(0, 1)[None]
    return sdpa_attention_forward(module, q, k2, v2, mask, **kw)
AttentionInterface.register("kvpq_sim", sim)
model.set_attn_implementation("kvpq_sim")
def run(**c):
    cfg.clear(); cfg.update(c)
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits[0, 1023:-1].double(), -1)
base = run(exact=True)
tgt = ids[0, 1024:]
nll0 = -base[torch.arange(len(tgt)), tgt].mean().item()
confs = [dict(kp="d4b8", vp="d4b8", frac=0), dict(kp="d4b8", vp="d4b8", frac=0.005), dict(kp="d4b8", vp="d4b8", frac=0.01),
         dict(kp="d4b8", vp="d4b8", frac=0.02), dict(kp="d4b8", vp=None, frac=0), dict(kp="d4b8", vp=None, frac=0.01)]
for c in confs:
    lp = run(**c)
    kl = (base.exp() * (base - lp)).sum(-1).mean().item()
    nll = -lp[torch.arange(len(tgt)), tgt].mean().item()
    top1 = (lp.argmax(-1) == base.argmax(-1)).double().mean().item()
    exf = cfg.get("nex", 0) / max(cfg.get("ntot", 1), 1)
    print(c, "KL %.4f dppl %+.2f%% top1 %.3f exact-frac %.4f" % (kl, 100 * (np.exp(nll - nll0) - 1), top1, exf), flush=True)
