#!/usr/bin/env python3
"""GPU benchmark of the kvpq CUDA backend, baselines side by side in one run (docs/BENCHMARKS.md).

Runs the C/CUDA timing binary (bench/gpu_bench_kernels.cu: ours and the seed-design kernel) and,
in this process, the PyTorch baselines on the same shapes:

  encode    seed design (one thread per sub-vector, codebook in device memory; search only),
            materializing path (PyTorch: (x - C) over (S, H, M, ksub, dsub), square, sum, argmin),
            PyTorch matmul + argmin (||c||^2 - 2 x C^T over (S*H*M, ksub)), ours (fused kernel:
            smoothing + Hadamard + search + packing; search on tensor cores, and beside it the
            float32 CUDA-core search of the same kernel).
  attend    decode attention from 2-bit codes (ours: kvpq_cuda_cache, window 128) against PyTorch
            scaled_dot_product_attention on fp16 K/V (enable_gqa=True), 32 query / 8 KV heads,
            head_dim 128, batch 1 and 8, contexts 4k, 32k, 128k.

Times are CUDA-event medians (CUDA-graph replays for the small attention kernels, on both sides);
GB/s counts bytes read (and written outputs for encode). The HBM ceiling is measured here with a
device-to-device copy. Writes results.json, table.md and PNG figures under --out.

Usage: python3 bench/gpu_bench.py --bin build/gpu_bench_kernels --out OUTDIR [--quick | --attend-only]
"""
import argparse
import datetime
import json
import os
import subprocess
import sys

try:
    import torch
except ImportError:  # --replot draws the figures from a results.json without a GPU or PyTorch
    torch = None


def cuda_time_us(fn, iters=10, reps=7, graph=False):
    """Median over reps of the mean time of iters calls (us)."""
    fn()
    torch.cuda.synchronize()
    if graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(iters):
                fn()
        run = g.replay
    else:
        def run():
            for _ in range(iters):
                fn()
    run()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1000.0 / iters)
    ts.sort()
    return ts[len(ts) // 2]


def peak_extra_bytes(fn):
    """Device memory allocated by fn beyond what was allocated before (PyTorch allocator)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def hbm_ceiling_GBps():
    n = 1 << 29  # 2 GiB of fp32
    a = torch.empty(n, dtype=torch.float32, device="cuda").normal_()
    b = torch.empty_like(a)
    us = cuda_time_us(lambda: b.copy_(a), iters=5, reps=5)
    del a, b
    return 2 * n * 4 / us / 1e3


def torch_encode(S, H, D, dsub, nbits, quick):
    M, ksub = D // dsub, 1 << nbits
    x = torch.randn(S, H, M, dsub, device="cuda")
    C = torch.randn(ksub, dsub, device="cuda")
    cn = (C * C).sum(-1)
    res = {}

    def materialize():
        diff = x.unsqueeze(-2) - C  # (S, H, M, ksub, dsub)
        return (diff * diff).sum(-1).argmin(-1)

    def matmul_argmin():
        xs = x.reshape(-1, dsub)
        return torch.addmm(cn, xs, C.t(), beta=1.0, alpha=-2.0).argmin(-1)

    for name, fn in (("materialize", materialize), ("torch_matmul_argmin", matmul_argmin)):
        try:
            mem = peak_extra_bytes(fn)
            us = cuda_time_us(fn, iters=2 if quick else 5, reps=3 if quick else 7)
            res[name + "_us"], res[name + "_extra_bytes"] = us, mem
        except torch.OutOfMemoryError:
            res[name + "_us"], res[name + "_extra_bytes"] = None, "OOM"
        torch.cuda.empty_cache()
    del x
    torch.cuda.empty_cache()
    return res


def torch_sdpa(B, L, quick):
    n_head, n_head_kv, D = 32, 8, 128
    q = torch.randn(B, n_head, 1, D, device="cuda", dtype=torch.float16)
    k = torch.randn(B, n_head_kv, L, D, device="cuda", dtype=torch.float16)
    v = torch.randn(B, n_head_kv, L, D, device="cuda", dtype=torch.float16)
    f = torch.nn.functional.scaled_dot_product_attention

    def fn():
        return f(q, k, v, enable_gqa=True)

    mem = peak_extra_bytes(fn)
    us = cuda_time_us(fn, iters=4 if quick else 20, reps=3 if quick else 15, graph=True)
    bytes_read = 2 * B * n_head_kv * L * D * 2 + q.numel() * 2
    kv_bytes = 2 * B * n_head_kv * L * D * 2
    del q, k, v
    torch.cuda.empty_cache()
    return {"sdpa_us": us, "sdpa_bytes_read": bytes_read, "sdpa_GBps": bytes_read / us / 1e3,
            "sdpa_extra_bytes": mem, "sdpa_kv_bytes": kv_bytes}


def fmt(v, nd=1):
    if v is None:
        return "OOM"
    if isinstance(v, str):
        return v
    return f"{v:.{nd}f}"


def mib(v):
    return v if isinstance(v, str) else f"{v / 2**20:.1f}"


def figures(enc, att, out, device):
    """gpu_encode.png and gpu_attend.png. Times on log axes; memory that can be 0 on a symlog axis
    (linear below 1 MiB, so 0 is drawn as 0 and labelled); legends below the panels, outside the bars."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    def below(fig, ax, ncol):
        handles, labels = ax.get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)

    if enc:  # --attend-only: no encode rows
        names = [("seed_us", "seed kernel"), ("materialize_us", "materializing (PyTorch)"),
                 ("torch_matmul_argmin_us", "PyTorch matmul+argmin"), ("ours_us", "ours (fused)")]
        labels = [f"S={e['S']} H={e['H']}\nD={e['D']} dsub={e['dsub']}" for e in enc]
        fig, ax = plt.subplots(1, 2, figsize=(12, 4.8))
        w = 0.2
        xs = np.arange(len(enc))
        for i, (k, lab) in enumerate(names):
            vals = [e.get(k) or 0 for e in enc]
            ax[0].bar(xs + (i - 1.5) * w, vals, w, label=lab, color=f"C{i}")
        ax[0].set_yscale("log")
        ax[0].set_xticks(xs, labels, fontsize=8)
        ax[0].set_ylabel("time per encode (us, log)")
        ax[0].set_title("PQ encode, nbits=8")
        # the same four methods as the time panel (seed kernel: its unpacked index output)
        mems = ["seed_output_bytes", "materialize_extra_bytes", "torch_matmul_argmin_extra_bytes",
                "ours_extra_bytes_during_encode"]
        top = 0
        for i, k in enumerate(mems):
            vals = [e.get(k) / 2**20 if isinstance(e.get(k), (int, float)) else np.nan for e in enc]
            top = max([top] + [v for v in vals if v == v])
            ax[1].bar(xs + (i - 1.5) * w, vals, w, color=f"C{i}")
            for x, v in zip(xs + (i - 1.5) * w, vals):
                if v == 0:
                    ax[1].annotate("0", (x, 0), xytext=(0, 2), textcoords="offset points", ha="center",
                                   va="bottom", fontsize=8, color=f"C{i}", fontweight="bold")
        ax[1].set_yscale("symlog", linthresh=1)
        ax[1].set_ylim(0, top * 4)
        ax[1].set_xticks(xs, labels, fontsize=8)
        ax[1].set_ylabel("device memory beyond inputs+codes (MiB, symlog: 0 at 0)")
        ax[1].set_title("encode: extra device memory (seed kernel: its unpacked index output)", fontsize=10)
        below(fig, ax[0], 4)
        fig.suptitle(device, fontsize=9)
        fig.tight_layout(rect=(0, 0.06, 1, 1))
        fig.savefig(os.path.join(out, "gpu_encode.png"), dpi=80)

    fig, ax = plt.subplots(1, 2, figsize=(12, 4.8))
    labels = [f"B={a['B']}\nL={a['L'] // 1024}k" for a in att]
    xs = np.arange(len(att))
    ax[0].bar(xs - 0.2, [a["sdpa_us"] for a in att], 0.4, label="PyTorch SDPA fp16 K/V (enable_gqa)", color="C0")
    ax[0].bar(xs + 0.2, [a["ours_us"] for a in att], 0.4, label="ours, 2-bit codes (resident: codes + window)",
              color="C1")
    ax[0].set_yscale("log")
    ax[0].set_xticks(xs, labels, fontsize=8)
    ax[0].set_ylabel("time per decode step (us, log)")
    ax[0].set_title("decode attention, 32/8 heads, head_dim 128")
    ax[1].bar(xs - 0.2, [a["sdpa_kv_bytes"] / 2**20 for a in att], 0.4, color="C0")
    ax[1].bar(xs + 0.2, [a["ours_resident_bytes"] / 2**20 for a in att], 0.4, color="C1")
    ax[1].set_yscale("log")
    ax[1].set_xticks(xs, labels, fontsize=8)
    ax[1].set_ylabel("KV memory of the layer (MiB, log)")
    ax[1].set_title("decode attention: KV bytes held")
    below(fig, ax[0], 2)
    fig.suptitle(device, fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(os.path.join(out, "gpu_attend.png"), dpi=80)


def replot(path, out, title):
    r = json.load(open(path))
    d = r["device"]
    figures(r.get("encode") or [], r.get("attend") or [], out, title or f"{d['device']} ({d.get('sms', '?')} SMs)")
    return 0



def variant_table(rows, title, columns):
    """Markdown lines of a table of kernel times: one row per (B, context) of rows, one column per
    (header, value-of-row function) in columns."""
    out = ["", title, "", "| B | context | " + " | ".join(h for h, _ in columns) + " |",
           "|---|---|" + "---|" * len(columns)]
    for t in rows:
        out.append(f"| {t['B']} | {t['L']} | " + " | ".join(fmt(get(t)) for _, get in columns) + " |")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin")
    ap.add_argument("--out", required=True)
    ap.add_argument("--replot", metavar="RESULTS_JSON", help="only draw the figures from a saved results.json")
    ap.add_argument("--title", help="with --replot: the figures' title (default: the device)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--attend-only", action="store_true", help="the attention shapes only (no encode)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.replot:
        return replot(a.replot, a.out, a.title)
    if not a.bin:
        ap.error("--bin is required (or --replot)")
    if torch is None or not torch.cuda.is_available():
        print("SKIP: no CUDA device for PyTorch")
        return 77
    cmd = [a.bin] + (["attends"] if a.attend_only else ["quick"] if a.quick else [])
    p = subprocess.run(cmd, capture_output=True, text=True)
    sys.stderr.write(p.stderr)
    rows = [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]
    if p.returncode != 0:
        print(p.stdout)
        print(f"gpu_bench_kernels failed with {p.returncode}")
        return 1
    dev = rows[0]
    enc = [r for r in rows if r.get("op") == "encode"]
    att = [r for r in rows if r.get("op") == "attend"]
    att_ne = [r for r in rows if r.get("op") == "attend_ne"]
    ceil = hbm_ceiling_GBps()
    for e in enc:
        e.update(torch_encode(e["S"], e["H"], e["D"], e["dsub"], e["nbits"], a.quick))
    for t in att:
        t.update(torch_sdpa(t["B"], t["L"], a.quick))
    device = f"{dev['device']} ({dev['sms']} SMs), torch {torch.__version__}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
    lines = [f"Device: {device}; measured HBM copy ceiling {ceil:.0f} GB/s (bytes read + written).", "",
             "Encode (nbits 8; times in us; extra = device memory beyond inputs and codes, MiB):", "",
             "| S | H | D | dsub | seed kernel | materializing | PyTorch matmul+argmin | ours (kernel) | ours, float32 search "
             "| ours (API call) | ours GB/s | speedup vs seed | vs matmul+argmin | extra MiB: materializing / matmul / ours |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in enc:
        mm = e.get("torch_matmul_argmin_us")
        lines.append(
            f"| {e['S']} | {e['H']} | {e['D']} | {e['dsub']} | {fmt(e['seed_us'])} | {fmt(e['materialize_us'])} | "
            f"{fmt(mm)} | {fmt(e['ours_us'])} | {fmt(e.get('ours_fp32_us'))} | {fmt(e['api_us'])} | {fmt(e['ours_GBps'], 0)} | "
            f"{e['seed_us'] / e['ours_us']:.1f}x | {fmt(mm / e['ours_us'] if mm else None)}x | "
            f"{mib(e['materialize_extra_bytes'])} / {mib(e['torch_matmul_argmin_extra_bytes'])} / "
            f"{mib(max(e['ours_extra_bytes_during_encode'], 0))} |")
    lines += ["", "Decode attention (32 query heads, 8 KV heads, head_dim 128; ours: 2-bit K and V codes, "
              "dsub 4, nbits 8, window 128; times in us; GB/s counts bytes read):", "",
              "| B | context | SDPA fp16 | SDPA GB/s | ours | ours GB/s | ours % of HBM ceiling | speedup | "
              "KV MiB fp16 / ours |", "|---|---|---|---|---|---|---|---|---|"]
    for t in att:
        lines.append(
            f"| {t['B']} | {t['L']} | {fmt(t['sdpa_us'])} | {fmt(t['sdpa_GBps'], 0)} | {fmt(t['ours_us'])} | "
            f"{fmt(t['ours_GBps'], 0)} | {100 * t['ours_GBps'] / ceil:.0f}% | {t['sdpa_us'] / t['ours_us']:.2f}x | "
            f"{t['sdpa_kv_bytes'] / 2**20:.0f} / {t['ours_resident_bytes'] / 2**20:.0f} |")
    V = lambda key: (lambda t: t.get("variant_us", {}).get(key))  # noqa: E731
    lines += variant_table(att, "Attention kernel variants (us; LUT kernel: entries float32/float16 x value codebook "
                           "plain/8 replicas, previous value loop; tensor-core kernel; "
                           f"ours = {att[0].get('default_variant', '?') if att else '?'}):",
                           [("LUT f32, plain", V("f32_plain")), ("LUT f16, plain", V("f16_plain")),
                            ("LUT f32, replicas", V("f32_vrep")), ("LUT f16, replicas", V("f16_vrep")),
                            ("LUT f16, replicas, previous value loop", V("default_prev_loop")),
                            ("tensor cores (default)", V("tc")), ("tensor cores, 8-warp CTAs", V("tc_8warps")),
                            ("tensor cores, 16-warp CTAs", V("tc_16warps")),
                            ("tensor cores, plain launch (no PDL)", V("tc_nopdl")),
                            ("tensor cores, split merge through device memory (no cluster)", V("tc_nocluster"))])
    lines += variant_table(att, "Tensor-core kernel, code rows and heads per CTA (session 15; us; the defaults but "
                           "for the named field):",
                           [("default", lambda t: t["ours_us"]),
                            ("code rows in registers (attend_tc_regs 1)", V("tc_regs")),
                            ("cp.async ring (attend_tc_regs 0)", V("tc_ring")), ("2 heads per CTA", V("tc_heads2")),
                            ("1 head per CTA", V("tc_heads1")), ("registers + 2 heads per CTA", V("tc_regs_heads2")),
                            ("SDPA fp16", lambda t: t.get("sdpa_us"))])
    if att_ne:
        plain = {(t["B"], t["L"]): t for t in att}
        lines += ["", "Decode attention, norm-explicit K and V codebooks (kvpq calibrate's default: codes of "
                  "directions + a float16 scale per position, KV head and kind; same shapes; us):", "",
                  "| B | context | ours, norm-explicit | ours GB/s | ours, plain codes (above) | cost of the scales | "
                  "LUT f16, replicas, norm-explicit | SDPA fp16 |", "|---|---|---|---|---|---|---|---|"]
        for t in att_ne:
            q = plain.get((t["B"], t["L"]), {})
            cost = 100 * (t["ours_us"] / q["ours_us"] - 1) if q.get("ours_us") else None
            lines.append(f"| {t['B']} | {t['L']} | {fmt(t['ours_us'])} | {fmt(t['ours_GBps'], 0)} | "
                         f"{fmt(q.get('ours_us'))} | {'-' if cost is None else fmt(cost, 0) + '%'} | "
                         f"{fmt(t.get('variant_us', {}).get('f16_vrep'))} | {fmt(q.get('sdpa_us'))} |")
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"device": dev, "hbm_copy_GBps": ceil, "encode": enc, "attend": att, "attend_ne": att_ne,
                   "command": " ".join(sys.argv)}, f, indent=1)
    figures(enc, att, a.out, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
