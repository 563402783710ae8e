#!/usr/bin/env python3
"""Turn `kvpq ppl --json` results into the main job's table, figure and README section.

Each input is the JSON that `kvpq ppl --cache A,B,... --kl-base fp16 --json` prints (schema
kvpq.ppl/1, docs/json.md): one row of "results" per tested cache. The table has one row per cache: effective bits per
element (codes plus codebooks, smoothing, window, over all stored elements), resident KV MiB,
perplexity, change of perplexity against the fp16 cache in %, mean KL(fp16 || cache), top-1
agreement with the fp16 cache, tokens/s of the run."""
import argparse
import datetime
import json
import os
import platform
import re
import subprocess

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def cache_name(o):
    name = o.get("cache") or o.get("spec") or "?"
    m = re.match(r"vq:.*cb_(\w+)\.safetensors(:w\d+)?$", name)
    return f"vq-{m.group(1)}{m.group(2) or ''}" if m else name


def family(name):
    return "vq" if name.startswith("vq") else "kivi" if name.startswith("kivi") else name if name.startswith("fp") else "q"


def load(path):
    with open(path) as f:
        data = json.load(f)
    if not (isinstance(data, dict) and data.get("schema") == "kvpq.ppl/1"):
        raise SystemExit(f"{path}: not the output of kvpq ppl --json (schema kvpq.ppl/1)")
    rows = data["results"]
    ctx = data["settings"].get("ctx")
    m = re.search(r"ctx(\d+)", os.path.basename(path))
    for r in rows:
        ctx = ctx or r.get("ctx") or (int(m.group(1)) if m else None)
        r["_ctx"] = ctx
        r["_name"] = cache_name(r)
    return ctx, rows


def table(ctx, rows):
    out = [f"Context {ctx}:", "",
           "| cache | bits/elem | KV MiB | KV / fp16 | ppl | Δppl vs fp16 | KL mean | KL p99 | top-1 agree | tok/s |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        base = r.get("ppl_base") or r["ppl"]
        r["_dppl"] = 100.0 * (r["ppl"] / base - 1.0)
        kv_base = r.get("kv_bytes_base") or r.get("kv_bytes", 0)
        out.append("| {} | {:.2f} | {:.2f} | {:.3f}x | {:.3f} ± {:.3f} | {:+.2f}% | {:.4f} | {:.4f} | {:.1f}% | {:.0f} |".format(
            r["_name"], r.get("bits_per_element", float("nan")), r.get("kv_bytes", 0) / 2**20,
            r.get("kv_bytes", 0) / kv_base if kv_base else float("nan"), r["ppl"],
            r.get("ppl_stderr", float("nan")), r["_dppl"], r.get("kl_mean", float("nan")),
            r.get("kl_p99", float("nan")), 100.0 * r.get("top1_agree", float("nan")), r.get("tok_per_s", float("nan"))))
    return "\n".join(out)


def figure(results, path):
    """Δppl against bits, one panel per context (every point labelled, labels moved apart by
    adjustText), and resident KV memory against bits; the legend sits below the panels, outside the
    data; Δppl on a symlog axis, so 0 (the fp16 cache) is drawn at 0."""
    from adjustText import adjust_text
    from matplotlib.lines import Line2D

    results = sorted(results, key=lambda cr: cr[0])
    n = len(results)
    fig, axes = plt.subplots(1, n + 1, figsize=(5.2 * (n + 1), 5.0))
    markers = {"fp16": "s", "q": "^", "kivi": "D", "vq": "o"}
    color = {f: f"C{i}" for i, f in enumerate(markers)}
    fills = {ctx: ("full" if i == n - 1 else "none") for i, (ctx, _) in enumerate(results)}
    for ax, (ctx, rows) in zip(axes, results):
        texts, xs, ys = [], [], []
        for r in rows:
            fam = family(r["_name"])
            x, y = r["bits_per_element"], r["_dppl"]
            ax.plot(x, y, linestyle="", marker=markers.get(fam, "x"), color=color.get(fam, "k"), fillstyle=fills[ctx])
            texts.append(ax.text(x, y, r["_name"], fontsize=7))
            xs.append(x)
            ys.append(y)
        ax.set_yscale("symlog", linthresh=1)
        ax.axhline(0, color="grey", lw=0.5)
        ax.set_xlabel("effective bits per element")
        ax.set_ylabel("Δ perplexity vs fp16 cache (%, symlog: 0 at 0)")
        ax.set_title(f"quality, context {ctx}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.set_xlim(0, max(xs) * 1.12)
        ax.set_ylim(-0.5, max(ys) * 3)
        adjust_text(texts, x=xs, y=ys, ax=ax, arrowprops=dict(arrowstyle="-", color="grey", lw=0.5),
                    expand=(1.2, 1.4), force_text=(0.3, 0.6))
    ax = axes[-1]
    for ctx, rows in results:
        for r in rows:
            fam = family(r["_name"])
            ax.plot(r["bits_per_element"], r["kv_bytes"] / 2**20, linestyle="", marker=markers.get(fam, "x"),
                    color=color.get(fam, "k"), fillstyle=fills[ctx])
    ax.set_xlabel("effective bits per element")
    ax.set_ylabel("resident KV cache (MiB)")
    ax.set_title("memory, every context", fontsize=10)
    ax.set_xlim(0, None)
    ax.set_ylim(0, None)
    ax.grid(alpha=0.3)
    handles = [Line2D([], [], marker=m, linestyle="", color=color[f], label=f) for f, m in markers.items()]
    handles += [Line2D([], [], marker="o", linestyle="", color="k", fillstyle=fills[ctx], label=f"ctx {ctx}")
                for ctx, _ in results]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=9, frameon=False)
    fig.suptitle("SmolLM2-135M, held-out novel (persuasion.txt): quality and memory against bits")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)


def machine():
    try:
        model = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except Exception:
        model = platform.processor()
    return f"{model}, {os.cpu_count()} cores"


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--readme")
    ap.add_argument("--figure")
    ap.add_argument("--command", default="./scripts/main_job.sh")
    ap.add_argument("--calib-log", help="`kvpq calibrate` output: its 'wrote FILE (...)' lines, one per codebook")
    a = ap.parse_args()
    results = [load(p) for p in a.inputs]
    text = "\n\n".join(table(ctx, rows) for ctx, rows in results)
    if a.calib_log and os.path.exists(a.calib_log):
        times, fwd, total = [], 0.0, 0.0
        for line in open(a.calib_log):
            m = re.search(r"wrote \S*?cb_(\w+)\.safetensors .*?(\d+) tokens; forward ([\d.]+) s, k-means ([\d.]+) s, "
                          r"total ([\d.]+) s", line)
            if m:
                times.append(f"{m.group(1)} {float(m.group(4)):.0f} s")
                ntok, fwd, total = m.group(2), float(m.group(3)), float(m.group(5))
        if times:
            text += (f"\n\nCalibration on {ntok} tokens of emma.txt, {os.cpu_count()} threads, one `kvpq calibrate` "
                     f"(`--also`): one forward pass {fwd:.0f} s, then k-means per codebook: " + ", ".join(times) +
                     f"; {total:.0f} s in all.")
    print(text)
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(text + "\n")
    if a.figure:
        os.makedirs(os.path.dirname(a.figure) or ".", exist_ok=True)
        figure(results, a.figure)
        print(f"figure: {a.figure}")
    if a.readme:
        try:
            rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        except Exception:
            rev = "?"
        section = (f"<!-- main-job:begin -->\nMeasured {datetime.date.today().isoformat()} on {machine()} "
                   f"(commit {rev}) by `{a.command}`:\n\n{text}\n\n![quality and memory against bits]({a.figure})\n"
                   "<!-- main-job:end -->")
        readme = open(a.readme).read()
        if "<!-- main-job:begin -->" in readme:
            readme = re.sub(r"<!-- main-job:begin -->.*<!-- main-job:end -->", lambda _: section, readme, flags=re.S)
        else:
            readme += "\n## Main job results\n\n" + section + "\n"
        open(a.readme, "w").write(readme)


if __name__ == "__main__":
    main()
