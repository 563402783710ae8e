"""Markdown table of `kvpq ppl --json --kl-base fp16` results (one or more files), with each
allocated codebook's budget, window, sinks, predicted KL and held-out KL of calibrate's joint check
(its alloc.* metadata; files before 2026-12-02 have no held-out KL) beside the measured KL. Usage: python3 scripts/alloc_table.py RESULT.json [...]  (docs/allocation.md)"""
import json
import sys

from main_job_models import cb_meta  # the codebook's __metadata__ (None when unreadable)


rows = []
for p in sys.argv[1:]:
    for r in json.load(open(p))["results"]:
        m = (cb_meta(r["cache"][3:]) or {}) if r["cache"].startswith("vq:") else {}
        rows.append((r, m))
rows.sort(key=lambda x: x[0]["bits_per_element"])
print("| cache | window, sinks | eff. bits | ppl | Δppl vs fp16 | KL mean | top-1 | predicted KL | predicted / measured | held-out KL | held-out / measured |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for r, m in rows:
    name = r["cache"]
    if m.get("alloc.bits"):
        name = f"kvpq --bits {m['alloc.bits']}"
    ws = f"{m['alloc.window']}, {m.get('alloc.sinks', '0')}" if m.get("alloc.window") else ""
    pred = float(m["alloc.predicted_kl"]) if m.get("alloc.predicted_kl") else None
    d = 100 * (r["ppl"] / r["ppl_base"] - 1)
    ps = "" if pred is None else "%.4f" % pred
    ratio = "" if pred is None else "%.2f" % (pred / r["kl_mean"])
    hk = float(m["alloc.holdout_kl"]) if m.get("alloc.holdout_kl") else None
    hs = "" if hk is None else "%.4f" % hk
    hratio = "" if hk is None else "%.2f" % (hk / r["kl_mean"])
    print(f"| {name} | {ws} | {r['bits_per_element']:.3f} | {r['ppl']:.3f} | {d:+.2f}% | {r['kl_mean']:.4f} | "
          f"{100 * r['top1_agree']:.1f}% | {ps} | {ratio} | {hs} | {hratio} |")
base = rows[0][0]
print(f"\nfp16 base ppl {base['ppl_base']:.3f} ({base['ctx']} ctx, {base['chunks']} chunks, {base['tokens']} scored tokens)")
