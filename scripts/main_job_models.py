#!/usr/bin/env python3
"""Issue #18's main-job table and figure: per model, every peer cache and kvpq's allocated VQ
codebooks (`kvpq calibrate --bits B`) on the held-out novel, with the fp16 cache as base.

Inputs are `kvpq ppl --json --kl-base fp16` outputs (schema kvpq.ppl/1). Usage:

    scripts/main_job_models.py --md docs/main_job.md --figure docs/main_job_models.png \
        --panel "SmolLM2-135M ctx 4096=out/mj/smol_ctx4096_kvpq.json,bench/results/main_job/main_job_ppl_ctx4096.json" ...

Rows whose cache is `vq:FILE` with an allocation (metadata alloc.*) are kvpq's (named "kvpq --bits B",
with " (f16 scales)" for files made before --bits defaulted to 8-bit norm-explicit scales): the table adds the
predicted KL (alloc.predicted_kl) and its ratio to the measured mean KL, and where the file has
it the KL of the file's joint check on held-out calibration text (alloc.holdout_kl) and its ratio; their points form the
frontier line in the figure. Other vq rows (uniform presets) are drawn hollow and named from the
codebook file (`cb_PRESET`) or its `keys` / `values` metadata, plus the window suffix. A codebook's
metadata is read from the file at the path the run recorded, else from a file of that name beside the
JSON, else from `codebooks_meta.json` beside the JSON (bench/results/main_job/ keeps only that).

Rows without a KL (a run without `--kl-base`, e.g. the Qwen peers) show "n/a" for KL and top-1; their
Δppl is the row's `delta_pct`, or else its ppl against the file's fp16 row, or its `ppl_base`.

With --md, an existing file that holds the markers `<!-- main_job_models: begin -->` and
`<!-- main_job_models: end -->` keeps everything outside them; only the part between is replaced
(docs/main_job.md carries other sections). A file without the markers is written whole."""
import argparse
import datetime
import json
import os
import re
import struct

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def cb_meta(path):
    """The __metadata__ of a safetensors codebook (None when unreadable)."""
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            return json.loads(f.read(n)).get("__metadata__", {})
    except OSError:
        return None


_SIDECAR = {}


def sidecar_meta(folder):
    """{codebook file name: __metadata__} from folder/codebooks_meta.json ({} when absent): the
    metadata of codebooks whose files are not kept (bench/results/main_job/)."""
    if folder not in _SIDECAR:
        path = os.path.join(folder, "codebooks_meta.json")
        _SIDECAR[folder] = json.load(open(path)) if os.path.exists(path) else {}
    return _SIDECAR[folder]


BEGIN, END = "<!-- main_job_models: begin -->", "<!-- main_job_models: end -->"


def num(r, key):
    """r[key] as a float, or None when missing or null (runs without --kl-base have no KL)."""
    v = r.get(key)
    return None if v is None else float(v)


def vq_name(spec, m, meta):
    mm = re.search(r"cb_(\w+)\.safetensors", spec)
    if mm:
        base = mm.group(1)
    elif meta and meta.get("keys"):
        k, v = meta["keys"], meta.get("values") or meta["keys"]
        base = k if k == v else f"{k}/{v}"  # keys/values
    else:
        base = os.path.basename(m.group(1))
    return "vq-" + base + (m.group(2) or "")


def codebook_meta(path, json_path):
    """A codebook's metadata: from the path a run recorded, else (a codebook not at its recorded
    path, e.g. out/ of the run) from a file of that name beside the JSON, else from the
    codebooks_meta.json beside it (the committed results keep the metadata only); None if none."""
    meta = cb_meta(path)
    if meta is None:
        meta = cb_meta(os.path.join(os.path.dirname(json_path), os.path.basename(path)))
    if meta is None:
        meta = sidecar_meta(os.path.dirname(json_path)).get(os.path.basename(path))
    return meta


def rows_of(paths):
    out, seen = [], set()
    for p in paths:
        d = json.load(open(p))
        if d.get("schema") != "kvpq.ppl/1":
            raise SystemExit(f"main_job_models: {p}: schema {d.get('schema')!r}, expected 'kvpq.ppl/1'")
        fp16 = next((num(r, "ppl") for r in d["results"] if r["cache"] == "fp16"), None)
        for r in d["results"]:
            spec = r["cache"]
            m = re.match(r"vq:(.*?)(:w\d+)?(:force)?$", spec)
            meta = codebook_meta(m.group(1), p) if m else None
            r["_alloc"] = meta if meta and "alloc.bits" in meta else None
            if r["_alloc"]:
                # files from before --bits took 8-bit norm-explicit scales by default (2026-12-04)
                f16 = (meta.get("k.norm") == "1" or meta.get("v.norm") == "1") and "8" not in (
                    meta.get("k.norm_bits"), meta.get("v.norm_bits"))
                r["_name"] = f"kvpq --bits {meta['alloc.bits']}" + (" (f16 scales)" if f16 else "")
            elif m:
                r["_name"] = vq_name(spec, m, meta)
            else:
                r["_name"] = spec
            if r["_name"] in seen:  # the first file given wins (newer runs first)
                continue
            seen.add(r["_name"])
            r["_src"] = p
            base = num(r, "ppl_base") or fp16
            r["_base"] = base
            if num(r, "delta_pct") is not None:
                r["_dppl"] = num(r, "delta_pct")
            elif base:
                r["_dppl"] = 100.0 * (r["ppl"] / base - 1.0)
            else:
                raise SystemExit(f"main_job_models: {p}: row {spec}: no ppl_base, delta_pct or fp16 row")
            out.append(r)
    return out


def table(title, rows):
    lines = [f"### {title}", "",
             "| cache | eff. bits | ppl | Δppl vs fp16 | KL mean | top-1 | predicted KL | predicted / measured "
             "| held-out KL | held-out / measured |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in sorted(rows, key=lambda r: r["bits_per_element"]):
        pk, ratio, hk, hratio = "", "", "", ""
        klm, top1 = num(r, "kl_mean"), num(r, "top1_agree")
        if r["_alloc"]:
            p = float(r["_alloc"]["alloc.predicted_kl"])
            pk = f"{p:.4f}"
            ratio = f"{p / klm:.2f}" if klm else "n/a"
            if "alloc.holdout_kl" in r["_alloc"]:  # the joint check of the written file (docs/allocation.md item 8)
                h = float(r["_alloc"]["alloc.holdout_kl"])
                hk = f"{h:.4f}"
                hratio = f"{h / klm:.2f}" if klm else "n/a"
        kls = "n/a" if klm is None else f"{klm:.4f}"
        t1 = "n/a" if top1 is None else f"{100 * top1:.1f}%"
        lines.append(f"| {r['_name']} | {r['bits_per_element']:.3f} | {r['ppl']:.3f} | {r['_dppl']:+.2f}% | "
                     f"{kls} | {t1} | {pk} | {ratio} | {hk} | {hratio} |")
    bases = sorted({f"{r['_base']:.3f}" for r in rows if r["_base"]})
    srcs = sorted({r["_src"] for r in rows})
    vctx = sorted({r["_alloc"]["alloc.verify_ctx"] for r in rows if r["_alloc"] and "alloc.verify_ctx" in r["_alloc"]})
    checked = f"; held-out KL: the joint check on {' / '.join(vctx)} tokens of the calibration text" if vctx else ""
    lines += ["", f"fp16 base ppl {' / '.join(bases)}{checked}; sources: " + ", ".join(f"`{s}`" for s in srcs)]
    return "\n".join(lines)


def cache_name(spec, json_path):
    """A passkey row's cache as the ppl tables name it: "kvpq --bits B" for an allocated codebook."""
    m = re.match(r"vq:(.*?)(:w\d+)?(:force)?$", spec)
    if not m:
        return spec
    meta = codebook_meta(m.group(1), json_path)
    if meta and "alloc.bits" in meta:
        return f"kvpq --bits {meta['alloc.bits']}"
    return vq_name(spec, m, meta)


def passkey_table(paths):
    """bench/passkey.py results as one table: a row per cache, a column per (ctx, depth), hits / trials."""
    cells, cols, names, settings = {}, [], [], []
    for p in paths:
        d = json.load(open(p))
        settings.append(d["settings"])
        for r in d["results"]:
            name, col = cache_name(r["cache"], p), (r["ctx"], r["depth"])
            names += [name] if name not in names else []
            cols += [col] if col not in cols else []
            cells[name, col] = f"{r['hits']}/{r['trials']}"
    cols.sort()
    model = os.path.basename(settings[0]["model"])
    lines = [f"### Passkey retrieval ({model})", "",
             "| cache | " + " | ".join(f"ctx {c} depth {dp:g}" for c, dp in cols) + " |",
             "| --- |" + " ---: |" * len(cols)]
    lines += [f"| {n} | " + " | ".join(cells.get((n, c), "") for c in cols) + " |" for n in names]
    lines += ["", "hits / trials: the greedy answer holds the passkey (bench/passkey.py, seed "
              f"{settings[0]['seed']}); sources: " + ", ".join(f"`{p}`" for p in paths)]
    return "\n".join(lines)


def figure(panels, path):
    n = len(panels)
    fig, axes = plt.subplots(1, n, figsize=(5.5 * n, 4.6), squeeze=False)
    for ax, (title, rows) in zip(axes[0], panels):
        kv = sorted([r for r in rows if r["_alloc"]], key=lambda r: r["bits_per_element"])
        for r in rows:
            if r["_alloc"] or r["_name"] == "fp16":
                continue
            hollow = r["_name"].startswith("vq-")
            ax.plot(r["bits_per_element"], r["_dppl"], "o" if hollow else "^", fillstyle="none" if hollow else "full",
                    color="grey" if hollow else "C1")
            ax.annotate(r["_name"], (r["bits_per_element"], r["_dppl"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        if kv:
            # the frontier: each allocated file that no other one beats at fewer or equal bits (older
            # files of a budget, e.g. with float16 scales, are drawn apart, hollow)
            front = [r for i, r in enumerate(kv) if all(q["_dppl"] > r["_dppl"] for q in kv[:i])]
            ax.plot([r["bits_per_element"] for r in front], [r["_dppl"] for r in front], "-o", color="C0",
                    label="kvpq --bits (allocated)")
            for r in kv:
                if r not in front:
                    ax.plot(r["bits_per_element"], r["_dppl"], "o", fillstyle="none", color="C0", ms=4)
            for r in front:
                ax.annotate(r["_name"].replace("kvpq ", ""), (r["bits_per_element"], r["_dppl"]), fontsize=7,
                            xytext=(3, -10), textcoords="offset points", color="C0")
        ax.set_yscale("symlog", linthresh=1)
        ax.axhline(0, color="grey", lw=0.5)
        ax.set_xlabel("effective bits per element (as kvpq ppl counts them)")
        ax.set_ylabel("Δ perplexity vs fp16 cache (%, symlog)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if kv:
            ax.legend(fontsize=8, loc="upper right")
    fig.suptitle("held-out novel (persuasion.txt): peers (triangles;\nhollow: uniform VQ presets) and kvpq's frontier", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--panel", action="append", required=True, help="TITLE=JSON[,JSON...]")
    ap.add_argument("--md", required=True)
    ap.add_argument("--figure", required=True)
    ap.add_argument("--preamble", default="", help="a file whose text goes before the tables")
    ap.add_argument("--passkey", action="append", default=[], help="a bench/passkey.py --json file (repeatable)")
    a = ap.parse_args()
    panels = []
    for p in a.panel:
        title, files = p.split("=", 1)
        panels.append((title, rows_of(files.split(","))))
    gen = []
    if a.preamble:
        gen.append(open(a.preamble).read())
    for title, rows in panels:
        gen += [table(title, rows), ""]
    if a.passkey:
        gen += [passkey_table(a.passkey), ""]
    gen.append(f"![delta perplexity against effective bits]({os.path.basename(a.figure)})")
    old = open(a.md).read() if os.path.exists(a.md) else ""
    if BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        body = head + BEGIN + "\n" + "\n".join(gen) + "\n" + END + tail
    else:
        body = "\n".join(["# Main job (issue #18): 2-bit caches on three models", "",
                          f"Generated {datetime.date.today().isoformat()} by `scripts/main_job_models.py`.", ""]
                         + gen) + "\n"
    open(a.md, "w").write(body)
    figure(panels, a.figure)


if __name__ == "__main__":
    main()
