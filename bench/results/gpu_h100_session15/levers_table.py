#!/usr/bin/env python3
"""Session 15's lever table from bench/gpu_bench.py's results.json (the device call ran main's gpu_bench.py,
which has no such table; the variant timings are in the JSON the branch's gpu_bench_kernels printed)."""
import json, sys
r = json.load(open(sys.argv[1]))
names = [("tc", "default (cp.async ring, up to 8 heads per CTA)"), ("tc_regs", "code rows in registers (attend_tc_regs 1)"),
         ("tc_heads2", "2 heads per CTA"), ("tc_heads1", "1 head per CTA"), ("tc_regs_heads2", "registers + 2 heads per CTA"),
         ("tc_nocluster", "split merge through device memory")]
for op in ("attend", "attend_ne"):
    print(f"\n{op} (us; {r['device']['device']}; out_fnv default / registers: equal bits where the same)\n")
    print("| B | context | SDPA fp16 | " + " | ".join(n for _, n in names) + " | registers / default | same bits |")
    print("|---" * (4 + len(names)) + "|---|")
    sd = {(t["B"], t["L"]): t.get("sdpa_us") for t in r["attend"]}
    for t in r[op]:
        v = t["variant_us"]
        same = t["out_fnv"][0] == t["out_fnv"][5]
        s = sd.get((t["B"], t["L"]))
        print(f"| {t['B']} | {t['L']} | {s:.1f} | " + " | ".join(f"{v[k]:.2f}" for k, _ in names) +
              f" | {v['tc_regs'] / v['tc']:.3f} | {'yes' if same else 'no'} |")
