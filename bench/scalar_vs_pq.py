#!/usr/bin/env python3
"""scalar_vs_pq.py — rotated scalar codes against PQ presets at equal bits, per layer (issue 30, item 2).

Issue 30 asks for TurboQuant-style scalar codes (one coordinate per code, after the Hadamard
rotation) as allocation candidates "where they beat PQ at equal bytes". This measures whether they
do, on a model's own keys and values, before the codebook format is widened for them (today a
codebook has one `nbits` per kind: a layer may change only M, so 2-, 3- and 4-bit scalar codes cannot
sit beside the 8-bit PQ presets in one file).

For each layer: the keys and values (post-RoPE, fp32 cache) of the calibration text train one
codebook per quantizer through the library's own recipe (`kvpq.calibrate_layer`: key mean,
query-aware smoothing, Hadamard, norm-explicit scale, k-means); the held-out text's keys and values
go through a VQ cache holding only codes (window 0, no sinks) and come back by `Cache.read`. Error:
sum |x^ - x|^2 / sum |x - mean|^2 over the held-out positions (mean over the held-out set), keys and
values apart. Every quantizer costs the same norm bits (a float16 scale per vector), so rows of one
bits column are equal bytes. TurboQuant's own codebook (`kvpq.turboquant_codebook`: fixed Lloyd-Max
levels, no centering, no smoothing) is the untrained reference.

Quantizers, by bits per element of codes (head_dim d); "/vrot" on a scalar row rotates its values too:
  1: d8b8 (M = d/8: the PQ preset; and /vrot) | scalar (M = d, 2 levels per coordinate; and /vrot) | tq1
  2: d4b8 (M = d/4, 256 centroids: the PQ preset) | the same with values Hadamard-rotated too ("/vrot",
     `calibrate --value-rotate 1`; keys always are) | scalar (M = d, 4 levels), one table shared by all
     coordinates / one per coordinate ("subspace"; and /vrot) | tq2
  3: d4b8+d8b8 (keys only: the allocation's 3-bit residual candidate) | d2b6 (M = d/2, 64 centroids:
     needs nbits 6; and /vrot) | scalar 8 levels (shared / per coordinate; and /vrot) | tq3
  4: d2b8 (the PQ preset; and /vrot) | scalar 16 levels (shared / per coordinate; and /vrot) | tq4

usage: python3 bench/scalar_vs_pq.py MODEL.gguf [--cal data/text/emma.txt] [--eval data/text/persuasion.txt]
           [--ctx 2048] [--cal-chunks 2] [--threads 2] [--json OUT]
"""
import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
import kvpq  # noqa: E402


def scalar_rows(d, b):
    """Scalar codes at b bits: levels shared by the coordinates (from 2 bits), one table per coordinate,
    the same with values rotated, and TurboQuant's fixed levels."""
    coord = dict(keys=(d, b), granularity="subspace")
    shared = [(f"scalar{b}", b, dict(keys=(d, b)))] if b > 1 else []
    return shared + [(f"scalar{b}/coord", b, coord), (f"scalar{b}/coord/vrot", b, dict(coord, value_rotate=True)),
                     (f"tq{b}", b, ("tq", b))]


def quantizers(d):
    """(name, bits, Codebook kwargs or ("tq", bits)) for head_dim d: per bits, the PQ rows, then scalar_rows."""
    pq = {1: [("d8b8", dict(keys="d8b8")), ("d8b8/vrot", dict(keys="d8b8", value_rotate=True))],
          2: [("d4b8", dict(keys="d4b8")), ("d4b8/vrot", dict(keys="d4b8", value_rotate=True))],
          3: [("d4b8+d8b8", dict(keys="d4b8", keys2="d8b8", values=(d // 2, 6))), ("d2b6", dict(keys=(d // 2, 6))),
              ("d2b6/vrot", dict(keys=(d // 2, 6), value_rotate=True))],
          4: [("d2b8", dict(keys="d2b8")), ("d2b8/vrot", dict(keys="d2b8", value_rotate=True))]}
    return [row for b in sorted(pq) for row in [(n, b, kw) for n, kw in pq[b]] + scalar_rows(d, b)]


def activations(model, tokens, ctx, threads):
    """Per layer (k, v) of tokens run in chunks of ctx, and the queries' |q| maxima (n_layer, n_head_kv, d)."""
    inf = model.info
    qa = np.zeros((inf["n_layer"], inf["n_head_kv"], inf["head_dim"]), np.float32)
    ks, vs = [[] for _ in range(inf["n_layer"])], [[] for _ in range(inf["n_layer"])]
    for c0 in range(0, len(tokens), ctx):
        cache = model.new_cache("fp32", max_seq=ctx, n_threads=threads)
        model.eval(cache, tokens[c0:c0 + ctx], query_absmax=qa)
        for layer in range(inf["n_layer"]):
            k, v = cache.read(layer)
            ks[layer].append(k)
            vs[layer].append(v)
    return [(np.concatenate(ks[l]), np.concatenate(vs[l])) for l in range(inf["n_layer"])], qa


def rel_err(x_hat, x):
    return float(((x_hat - x) ** 2).sum() / ((x - x.mean(axis=0)) ** 2).sum())


def layer_codebook(spec, inf, k, v, qa, threads):
    """A one-layer codebook for spec, trained on (k, v) where the spec trains."""
    if isinstance(spec, tuple):
        return kvpq.turboquant_codebook(1, inf["n_head_kv"], inf["head_dim"], spec[1])
    kw = dict(spec)
    kw.setdefault("values", kw["keys"])
    cb = kvpq.Codebook(1, inf["n_head_kv"], inf["head_dim"], **kw)
    kvpq.calibrate_layer(cb, 0, k, v, query_absmax=qa, n_threads=threads)
    return cb


def held_out_error(cb, inf, k, v, threads):
    cache = kvpq.Cache("vq", 1, inf["n_head"], inf["n_head_kv"], inf["head_dim"], len(k), codebook=cb,
                       window=0, sinks=0, n_threads=threads)
    cache.append(0, k, v)
    k_hat, v_hat = cache.read(0)
    return rel_err(k_hat, k), rel_err(v_hat, v)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--cal", default=os.path.join(ROOT, "data", "text", "emma.txt"))
    ap.add_argument("--eval", default=os.path.join(ROOT, "data", "text", "persuasion.txt"))
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--cal-chunks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    t0 = time.time()
    model = kvpq.Model(a.model, n_threads=a.threads)
    inf = model.info
    cal_tok = model.tokenize(open(a.cal, encoding="utf-8").read(), add_bos=True)[:a.ctx * a.cal_chunks]
    ev_tok = model.tokenize(open(a.eval, encoding="utf-8").read(), add_bos=True)[:a.ctx]
    cal, qa = activations(model, cal_tok, a.ctx, a.threads)
    ev, _ = activations(model, ev_tok, a.ctx, a.threads)
    qs = quantizers(inf["head_dim"])
    rows = []
    for layer in range(inf["n_layer"]):
        k, v = cal[layer]
        for name, bits, spec in qs:
            cb = layer_codebook(spec, inf, k, v, qa[layer], a.threads)
            ek, ev_ = held_out_error(cb, inf, ev[layer][0], ev[layer][1], a.threads)
            rows.append(dict(layer=layer, quantizer=name, bits=bits, key_err=ek, value_err=ev_))
        print(f"layer {layer:2d} " + "  ".join(f"{r['quantizer']} {r['key_err']:.4f}/{r['value_err']:.4f}"
                                              for r in rows[-len(qs):]), flush=True)
    print(f"\n{os.path.basename(a.model)}: held-out relative error, mean over {inf['n_layer']} layers "
          f"(keys / values); layers where the quantizer beats its bits' PQ preset")
    for name, bits, _ in qs:
        sel = [r for r in rows if r["quantizer"] == name]
        base = {1: "d8b8", 2: "d4b8", 3: "d4b8+d8b8", 4: "d2b8"}[bits]
        ref = {r["layer"]: r for r in rows if r["quantizer"] == base}
        wk = sum(r["key_err"] < ref[r["layer"]]["key_err"] for r in sel)
        wv = sum(r["value_err"] < ref[r["layer"]]["value_err"] for r in sel)
        print(f"  {bits} b  {name:14s} keys {np.mean([r['key_err'] for r in sel]):.4f}  values "
              f"{np.mean([r['value_err'] for r in sel]):.4f}   beats {base}: keys {wk}/{inf['n_layer']}, "
              f"values {wv}/{inf['n_layer']}")
    print(f"({time.time() - t0:.0f} s)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(model=a.model, cal=a.cal, eval=a.eval, ctx=a.ctx, cal_chunks=a.cal_chunks, rows=rows,
                           note="3-bit d4b8+d8b8 codes values as d2b6 (values have no residual stage)"), f, indent=1)


if __name__ == "__main__":
    main()
