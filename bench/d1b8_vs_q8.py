#!/usr/bin/env python3
"""Why kvpq's 8-bit preset d1b8 loses to q8_0r at 8.5 bits (issue #18's frontier): the relative
squared error of the reconstruction of real keys and values, per layer, of

  - q8_0r: llama.cpp's q8_0 (blocks of 32, absmax scale in float16, int8 codes) after the
    normalized Hadamard rotation (as kvpq's q8_0r cache does),
  - d1b8: kvpq's norm-explicit 256-level scalar quantizer with one set of levels shared by every
    channel (kvpq.ProductQuantizer M = head_dim, nbits 8, trained by kvpq's k-means on the
    directions), the least-squares scale per vector (float16 rounding not applied),
  - d1b8 with per-channel standardization (levels shared, each channel divided by its std first),

on SmolLM2-135M's keys (centered, smoothed by lambda = sqrt(max |K - mu|), rotated) and values
(values as kvpq codes them by default: not rotated; with --rotate-values rotated too). Calibration:
2048 tokens of emma.txt; evaluation: 1024 later tokens of the same novel (the quantizers are 1-D:
little to overfit). Error = sum |x_hat - x|^2 / sum |x|^2 over the evaluation vectors.

Usage: KVPQ_LIB=build/libkvpq.so python3 bench/d1b8_vs_q8.py [--rotate-values] [--text PATH]"""
import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
import kvpq  # noqa: E402


def q8_0(x, blk=32):
    n, d = x.shape
    y = x.reshape(n, d // blk, blk)
    s = (np.abs(y).max(-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    s[s == 0] = 1
    return (np.clip(np.round(y / s), -127, 127) * s).reshape(n, d)


def d1b8(U, UE, nre, d):
    pq = kvpq.ProductQuantizer(d=d, M=d, nbits=8)
    pq.train(np.ascontiguousarray(U, np.float32))
    rec = pq.decode(pq.encode(np.ascontiguousarray(UE, np.float32)))
    return rec * ((UE * rec).sum(1, keepdims=True) / (rec * rec).sum(1, keepdims=True)) * nre


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--text", default=str(ROOT / "data" / "text" / "emma.txt"))
    ap.add_argument("--layers", default="3,13,20")
    ap.add_argument("--rotate-values", action="store_true")
    a = ap.parse_args()
    m = kvpq.Model(a.model, n_threads=2)
    tok = m.tokenize(open(a.text).read(), add_bos=True)
    caches = []
    for part in (tok[:2048], tok[20000:21024]):
        c = m.new_cache("fp32", max_seq=len(part))
        m.eval(c, part)
        caches.append(c)
    print("layer kind  q8_0r     d1b8      d1b8/chan-std  d1b8/q8_0r")
    for layer in map(int, a.layers.split(",")):
        (k, v), (ke, ve) = caches[0].read(layer), caches[1].read(layer)
        for name, X, XE in (("K", k, ke), ("V", v, ve)):
            d = X.shape[2]
            if name == "K":
                mu = X.mean(0)
                lam = kvpq.smooth_compute(X - mu)
                X, XE = kvpq.smooth_apply(X - mu, lam), kvpq.smooth_apply(XE - mu, lam)
            R, RE = X.reshape(-1, d).copy(), XE.reshape(-1, d).copy()
            if name == "K" or a.rotate_values:
                R, RE = kvpq.hadamard(R), kvpq.hadamard(RE)
            nr, nre = np.linalg.norm(R, axis=1, keepdims=True), np.linalg.norm(RE, axis=1, keepdims=True)
            U, UE = R / nr, RE / nre
            err = lambda rec: float(((rec - RE) ** 2).sum() / (RE ** 2).sum())  # noqa: E731
            e_q8 = err(kvpq.hadamard(q8_0(kvpq.hadamard(RE.copy()))))  # q8_0r of the (rotated) vector
            e_d1 = err(d1b8(U, UE, nre, d))
            sd = U.std(0)
            Us, UEs = U / sd, UE / sd
            pq = kvpq.ProductQuantizer(d=d, M=d, nbits=8)
            pq.train(np.ascontiguousarray(Us, np.float32))
            rec = pq.decode(pq.encode(np.ascontiguousarray(UEs, np.float32))) * sd
            e_sd = err(rec * ((UE * rec).sum(1, keepdims=True) / (rec * rec).sum(1, keepdims=True)) * nre)
            print(f"{layer:5d} {name}     {e_q8:.2e}  {e_d1:.2e}  {e_sd:.2e}       {e_d1 / e_q8:.2f}", flush=True)


if __name__ == "__main__":
    main()
