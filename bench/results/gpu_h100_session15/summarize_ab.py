#!/usr/bin/env python3
"""Summarize session 15's A/B attention runs: gpu_bench_kernels `attends` JSON lines, files given as
LABEL=PATH; prints one row per (op, B, L) with every variant timed in each file (us)."""
import json, sys
names = {"tc": "5", "tc_nocluster": "9", "tc_regs": "a", "tc_ring": "b", "tc_heads2": "c", "tc_heads1": "d",
         "tc_regs_heads2": "e"}
rows = {}
cols = []
for arg in sys.argv[1:]:
    label, path = arg.split("=", 1)
    for l in open(path):
        if not l.startswith('{"op"'):
            continue
        r = json.loads(l)
        key = (r["op"], r["B"], r["L"])
        for n, v in r["variant_us"].items():
            if n in names and v > 0:
                c = f"{label}:{names[n]}"
                if c not in cols:
                    cols.append(c)
                rows.setdefault(key, {})[c] = v
        fn = r.get("out_fnv", [])
        rows.setdefault(key, {})[f"{label}:fnv"] = " ".join(x[:6] for x in fn[:6] if x != "0000000000000000")
print("| op | B | L | " + " | ".join(cols) + " | fnv (per file) |")
print("|---" * (4 + len(cols)) + "|")
for key in sorted(rows, key=lambda k: (k[0], k[1], k[2])):
    r = rows[key]
    fnv = "; ".join(r.get(f"{a.split('=')[0]}:fnv", "") for a in sys.argv[1:])
    print(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(f"{r[c]:.2f}" if c in r else "-" for c in cols) + f" | {fnv} |")
