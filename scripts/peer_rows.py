#!/usr/bin/env python3
"""peer_rows.py — the peer rows of the main job (issue 18) from `kvpq ppl --json` outputs.

usage: python3 scripts/peer_rows.py --model NAME --ctx L [--table] -o OUT.json IN.json [IN.json ...]

Merges the results of one or more `kvpq ppl --json` runs on the same model, text, context and chunks
(schema kvpq.ppl/1, docs/json.md) into one file of the same schema. Runs made with `--kl-base fp16`
carry the fp16 base's perplexity and bits in every row: the fp16 row is written from them (KL 0,
top-1 1.0: the base against itself) rather than computing fp16 twice. A run without --kl-base gives
rows without KL and top-1 (null). Each row gains delta_pct: 100 (ppl / ppl_fp16 - 1). --table also
prints a Markdown table.
"""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--ctx", type=int, required=True)
    ap.add_argument("--table", action="store_true")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("inputs", nargs="+")
    a = ap.parse_args()
    runs = [json.load(open(p)) for p in a.inputs]
    rows, base = {}, None
    for r in runs:
        if r["settings"].get("ctx", a.ctx) != a.ctx:
            sys.exit(f"peer_rows: {r['settings']} is not ctx {a.ctx}")
        for x in r["results"]:
            rows[x["cache"]] = dict(x)
            if x.get("kl_base") == "fp16" and base is None:
                base = {"cache": "fp16", "ppl": x["ppl_base"], "ppl_stderr": x["ppl_base_stderr"],
                        "tokens": x["tokens"], "chunks": x.get("chunks"), "ctx": x.get("ctx"),
                        "kv_bytes": x["kv_bytes_base"], "bits_per_element": x["bits_per_element_base"], "tok_per_s": None,
                        "kl_base": "fp16", "ppl_base": x["ppl_base"], "kl_mean": 0.0, "kl_p99": 0.0,
                        "top1_agree": 1.0, "from": "the fp16 base run"}
    if "fp16" not in rows and base:
        rows = {"fp16": base, **rows}
    f = rows.get("fp16")
    for x in rows.values():
        x["delta_pct"] = 100.0 * (x["ppl"] / f["ppl"] - 1.0) if f else None
    out = dict(runs[0])
    out["settings"] = dict(runs[0]["settings"], model_name=a.model)
    out["results"] = list(rows.values())
    with open(a.out, "w") as fh:
        json.dump(out, fh, indent=1)
        fh.write("\n")
    if a.table:
        print(f"| cache | bits/elem | ppl | delta | KL mean | top-1 |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for x in rows.values():
            kl, t1, d = x.get("kl_mean"), x.get("top1_agree"), x["delta_pct"]
            ds = "" if d is None else "%+.1f%%" % d
            ks = "-" if kl is None else "%.4f" % kl
            ts = "-" if t1 is None else "%.1f%%" % (100 * t1)
            print(f"| {x['cache']} | {x['bits_per_element']:.2f} | {x['ppl']:.3f} | {ds} | {ks} | {ts} |")

if __name__ == "__main__":
    main()
