#!/usr/bin/env python3
"""Attention of one whole decode step of a 32-layer model on the GPU, baselines in this process.

Shapes of Llama-3-8B: 32 layers, 32 query heads, 8 KV heads, head_dim 128; batch 1 and 8, contexts
4k to 128k. Per step, one query per sequence and layer attends to the whole context; the layers
run one after another on one stream (in a model, layer l + 1's query needs layer l's output).

  kvpq graph    kvpq_cuda_cache_attend_async of all 32 layers (one kvpq_cuda_cache each, 2-bit
                K and V codes: dsub 4, nbits 8, window 128) captured into ONE CUDA graph: one
                launch per step
  kvpq eager    the same 32 calls launched one by one from Python (the kvpq package's cffi binding)
  ... no PDL    the same with kernels.attend_pdl = 0: each attention kernel a plain launch (session 6);
                by default (attend_pdl = 1) each is a programmatic dependent launch, whose prologue
                (codebook image, page table, first code tiles) overlaps the previous layer's kernel
                and which waits for that kernel to finish before it reads its query
  SDPA eager    32 torch.nn.functional.scaled_dot_product_attention calls on fp16 K/V
                (enable_gqa=True), launched one by one from Python: what an eager decode loop does
  SDPA graph    the same 32 SDPA calls captured into one CUDA graph

Each layer has its own cache / K and V tensors (SDPA: as many distinct layers as fit in
--sdpa-gib, the others reuse them cyclically; every set is many times the 60 MB L2). Times: CUDA
events around a whole step, median over repeats after a warm-up. Before timing, every layer's
output of the kvpq graph (outputs poisoned with NaN first) must equal the synchronous
kvpq_cuda_cache_attend's bit for bit, and the SDPA graph's eager SDPA's to float16 rounding (its
split-KV kernels are not bitwise deterministic run to run).

Usage: python3 bench/gpu_decode_step.py [--lib build/libkvpq.so] [--out DIR] [--quick]
Writes decode_step.json and decode_step.md under --out (default out/gpu).
"""
import argparse
import datetime
import json
import math
import os
import sys

import torch

N_LAYER, N_HEAD, N_HEAD_KV, D, WINDOW = 32, 32, 8, 128, 128


def load(path):
    """The kvpq package (cffi, declared from the installed header: no hand-copied structs) over the
    library at `path` (a CUDA build's libkvpq.so), or the installed package's when path is None."""
    if path:
        os.environ["KVPQ_LIB"] = os.path.abspath(path)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
    import kvpq
    return kvpq


def ok(kvpq, status, what):
    if status != 0:
        raise RuntimeError(f"{what}: status {status}: {kvpq.last_error()}")


def step_time_us(run, reps):
    """Median over reps of one call of run (a whole step), CUDA events, after a warm-up."""
    run()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1000.0)
    ts.sort()
    return ts[len(ts) // 2]


def capture(fn):
    """fn captured into a CUDA graph on a side stream (warmed up first)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        fn()
    torch.cuda.synchronize()
    return g


def kvpq_step(kvpq, B, L, reps, gen, pdl=1):
    ffi, lib = kvpq.ffi, kvpq.lib
    pq = []
    for _ in range(2):  # key and value quantizers, random centroids (speed does not depend on training)
        q = kvpq.ProductQuantizer(d=D, M=D // 4, nbits=8)
        q.centroids = torch.randn(q.ksub, q.dsub, generator=gen).float().numpy()
        pq.append(q)
    lam = (0.5 + torch.randn(N_HEAD_KV, D, generator=gen).abs()).float().contiguous()
    cp = ffi.new("kvpq_cuda_cache_params *", lib.kvpq_cuda_cache_params_default())
    cp.n_head, cp.n_head_kv, cp.head_dim, cp.n_seq, cp.max_seq = N_HEAD, N_HEAD_KV, D, B, L
    cp.window, cp.page_tokens, cp.value_rotate = WINDOW, 256, 1
    cp.key, cp.value, cp.key_smooth = pq[0]._h, pq[1]._h, ffi.cast("float *", lam.data_ptr())
    F = lambda t: ffi.cast("float *", t.data_ptr())  # noqa: E731
    cp.kernels.attend_pdl = pdl
    piece = min(L, 32768)
    caches = []
    for layer in range(N_LAYER):
        hp = ffi.new("kvpq_cuda_cache **")
        ok(kvpq, lib.kvpq_cuda_cache_new(hp, cp), "kvpq_cuda_cache_new")
        h = ffi.gc(hp[0], lib.kvpq_cuda_cache_free)
        caches.append(h)
        for b in range(B):
            for t in range(0, L, piece):
                n = min(piece, L - t)
                k = torch.randn(n, N_HEAD_KV, D, device="cuda")
                v = torch.randn(n, N_HEAD_KV, D, device="cuda")
                ok(kvpq, lib.kvpq_cuda_cache_append(h, b, n, F(k), F(v)), "append")
    del k, v
    resident = sum(lib.kvpq_cuda_cache_resident_bytes(h) for h in caches)
    q = [torch.randn(B, N_HEAD, D, device="cuda") for _ in range(N_LAYER)]
    out = [torch.empty(B, N_HEAD, D, device="cuda") for _ in range(N_LAYER)]
    ref = [torch.empty(B, N_HEAD, D, device="cuda") for _ in range(N_LAYER)]
    for layer in range(N_LAYER):
        ok(kvpq, lib.kvpq_cuda_cache_attend(caches[layer], B, F(q[layer]), F(ref[layer])), "attend")
    bad = []

    def launches():
        st = ffi.cast("void *", torch.cuda.current_stream().cuda_stream)
        for layer in range(N_LAYER):
            s = lib.kvpq_cuda_cache_attend_async(caches[layer], B, F(q[layer]), F(out[layer]), st)
            if s != 0:
                bad.append((layer, s, kvpq.last_error()))

    g = capture(launches)
    if bad:
        raise RuntimeError(f"kvpq_cuda_cache_attend_async failed: {bad[:3]}")
    for o in out:
        o.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    for layer in range(N_LAYER):  # the graph computes what the synchronous call does, every element written
        if not torch.equal(out[layer], ref[layer]):
            raise RuntimeError(f"kvpq graph, layer {layer}: output differs from kvpq_cuda_cache_attend "
                               f"(max |diff| {(out[layer] - ref[layer]).abs().max().item():g})")
    graph_us = step_time_us(g.replay, reps)
    eager_us = step_time_us(launches, reps)
    if bad:
        raise RuntimeError(f"kvpq_cuda_cache_attend_async failed: {bad[:3]}")
    del g, caches, pq  # freed by their ffi.gc finalizers
    coded = B * max(L - WINDOW, 0) * N_HEAD_KV * (32 + 32)  # 32-byte key and value code rows
    win = B * min(L, WINDOW) * N_HEAD_KV * D * 4 * 2
    bytes_read = N_LAYER * (coded + win + B * N_HEAD * D * 4)
    return {"kvpq_graph_us": graph_us, "kvpq_eager_us": eager_us, "kvpq_bytes_read": bytes_read,
            "kvpq_resident_bytes": resident}


def sdpa_step(B, L, reps, gib):
    per_layer = 2 * B * N_HEAD_KV * L * D * 2
    n_sets = max(1, min(N_LAYER, int(gib * 2**30 // per_layer)))
    kv = [(torch.randn(B, N_HEAD_KV, L, D, device="cuda", dtype=torch.float16),
           torch.randn(B, N_HEAD_KV, L, D, device="cuda", dtype=torch.float16)) for _ in range(n_sets)]
    q = [torch.randn(B, N_HEAD, 1, D, device="cuda", dtype=torch.float16) for _ in range(N_LAYER)]
    f = torch.nn.functional.scaled_dot_product_attention
    outs = [None] * N_LAYER

    def launches():
        for layer in range(N_LAYER):
            k, v = kv[layer % n_sets]
            outs[layer] = f(q[layer], k, v, enable_gqa=True)

    launches()
    torch.cuda.synchronize()
    ref = [o.clone() for o in outs]
    eager_us = step_time_us(launches, reps)
    g = capture(launches)
    for o in outs:
        o.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    for layer in range(N_LAYER):
        # SDPA's split-KV decode kernels need not be bitwise deterministic: float16 rounding apart
        if not torch.allclose(outs[layer].float(), ref[layer].float(), rtol=2e-3, atol=2e-3):
            raise RuntimeError(f"SDPA graph, layer {layer}: output differs from eager SDPA "
                               f"(max |diff| {(outs[layer].float() - ref[layer].float()).abs().max().item():g})")
    graph_us = step_time_us(g.replay, reps)
    del g, kv, q, outs, ref
    torch.cuda.empty_cache()
    return {"sdpa_eager_us": eager_us, "sdpa_graph_us": graph_us, "sdpa_distinct_layers": n_sets,
            "sdpa_bytes_read": N_LAYER * (per_layer + B * N_HEAD * D * 2), "sdpa_kv_bytes": N_LAYER * per_layer}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", help="the kvpq shared library of a CUDA build (libkvpq.so); default: the installed "
                    "kvpq package's (KVPQ_CUDA=ON pip install .)")
    ap.add_argument("--out", default="out/gpu")
    ap.add_argument("--quick", action="store_true", help="batch 1 at 4k and 32k, fewer repeats")
    ap.add_argument("--sdpa-gib", type=float, default=40.0, help="device memory for distinct SDPA layers")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device for PyTorch")
        return 77
    kvpq = load(a.lib)
    avail, why = kvpq.cuda_available()
    if not avail:
        print(f"SKIP: {why}")
        return 77
    os.makedirs(a.out, exist_ok=True)
    gen = torch.Generator().manual_seed(1)
    shapes = [(1, 4096), (1, 32768)] if a.quick else [(b, l) for b in (1, 8) for l in (4096, 32768, 131072)]
    rows = []
    for B, L in shapes:
        reps = 5 if a.quick else (30 if B * L <= 32768 else 10)
        r = {"B": B, "L": L}
        r.update(kvpq_step(kvpq, B, L, reps, gen))
        torch.cuda.empty_cache()
        r0 = kvpq_step(kvpq, B, L, reps, gen, pdl=0)
        r.update({"kvpq_graph_nopdl_us": r0["kvpq_graph_us"], "kvpq_eager_nopdl_us": r0["kvpq_eager_us"]})
        torch.cuda.empty_cache()
        r.update(sdpa_step(B, L, reps, a.sdpa_gib))
        rows.append(r)
        print(json.dumps(r), flush=True)
    dev = torch.cuda.get_device_properties(0)
    when = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
    lines = [f"Device: {dev.name} ({dev.multi_processor_count} SMs), torch {torch.__version__}, {when}.", "",
             f"Attention of one decode step, {N_LAYER} layers ({N_HEAD} query heads, {N_HEAD_KV} KV heads, head_dim "
             f"{D}); ours: 2-bit K and V codes (dsub 4, nbits 8), window {WINDOW}; us per step (per layer in "
             "brackets):", "",
             "| B | context | SDPA eager (32 launches) | SDPA graph | kvpq eager (32 launches) | kvpq graph (1 launch) "
             "| kvpq graph GB/s | vs SDPA eager | vs SDPA graph | kvpq graph, no PDL | kvpq eager, no PDL "
             "| KV GiB fp16 / ours |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        def us(k):
            return f"{r[k]:.1f} ({r[k] / N_LAYER:.2f})"
        lines.append(f"| {r['B']} | {r['L']} | {us('sdpa_eager_us')} | {us('sdpa_graph_us')} | {us('kvpq_eager_us')} "
                     f"| {us('kvpq_graph_us')} | {r['kvpq_bytes_read'] / r['kvpq_graph_us'] / 1e3:.0f} "
                     f"| {r['sdpa_eager_us'] / r['kvpq_graph_us']:.2f}x | {r['sdpa_graph_us'] / r['kvpq_graph_us']:.2f}x "
                     f"| {us('kvpq_graph_nopdl_us')} | {us('kvpq_eager_nopdl_us')} "
                     f"| {r['sdpa_kv_bytes'] / 2**30:.2f} / {r['kvpq_resident_bytes'] / 2**30:.2f} |")
    lines += ["", "SDPA layers with their own K/V: " +
              ", ".join(f"B={r['B']} L={r['L']}: {r['sdpa_distinct_layers']}" for r in rows) + " (of 32)."]
    md = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "decode_step.md"), "w") as fh:
        fh.write(md)
    with open(os.path.join(a.out, "decode_step.json"), "w") as fh:
        json.dump({"device": dev.name, "when": when, "rows": rows}, fh, indent=1)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
