#!/usr/bin/env python3
"""longctx_peer.py — decode at long context: kvpq beside llama.cpp and quant.cpp (issue 34, item 3).

For each model and context N: the first N tokens of a text as the prompt (prefilled), then --steps
one-token decodes fed from the text's next tokens (teacher forcing, so every engine does the same
work whatever it would sample). One process per (engine, cache) measurement, so that its peak RSS is
its own (ru_maxrss of the child, from wait4). Reported per run: prefill tok/s (the prompt's tokens /
its wall time), decode tok/s (1 / the median one-token step, the statistic of `kvpq bench decode`),
peak RSS and the KV cache's bytes.

Runs (--caches, ENGINE:CACHE):
  kvpq:fp16, kvpq:b2.5, kvpq:b3.0  `kvpq bench decode --cache fp16 | vq:CODEBOOK` (one cache per process);
                                   bN.N takes --codebook-dir/<prefix>_pq_bN.N.safetensors (`kvpq calibrate
                                   --bits N.N`; prefix smol / qwen2.5 / gemma3); KV bytes = stored_bytes
  llama:f16, llama:q8_0, llama:q4_0  bench/llama_cpp_speed.c `ctx` mode against --llama-bin's libllama:
                                   the same ids, flash attention on, K and V of that type; KV bytes =
                                   llama_state_seq_get_size
  qcpp:uniform_4b, qcpp:turbo_kv_4b  quant.cpp's library (--qcpp-lib, scripts/build_quantcpp_peer.sh) through
                                   ctypes in a child python: its default load (weights converted to its
                                   Q4 at load), tq_forward_batch for the prompt where its engine has it
                                   (else token by token, as its tq_generate), tq_forward per step;
                                   uniform_4b is quant.cpp's default kv_type. KV bytes: its quantized keys
                                   (whole blocks per head) and fp16 values, without the fp32 key buffer
                                   it also allocates (as bench/quantcpp_peer.py counts). The child's RSS
                                   includes the python interpreter (~10 MiB). Contexts above --qcpp-max-ctx
                                   skip it.
Missing peers (no libllama / no quant.cpp library / no codebook) are reported and skipped.

Rounds: --rounds R (per context: --rounds-at CTX:R,...); in each round every run once, the order
reversed on odd rounds (alternation, so the load of a shared machine falls on all alike); each figure
is the median over the rounds; ratios (kvpq:b2.5 over each other run) are medians of the per-round
ratios. Same --threads for all, OMP_WAIT_POLICY=PASSIVE. SIMD level of each engine printed.
Contexts above the model's training context minus --steps are cut to it (SmolLM2: 8192 - 64).

Token ids: llama.cpp's tokenizer (llama-tokenize or the client's `tok`), identical to kvpq's on these
models (docs/tokenizer.md); kvpq bench decode tokenizes --text itself. Text: --text, default
data/text/persuasion.txt of the repository (~110k tokens).

usage: python3 bench/longctx_peer.py [--models smollm2,qwen2.5-coder-1.5b] [--ctx 512,4096,16384,32768]
          [--steps 64] [--threads 2] [--rounds 3] [--rounds-at 16384:1] [--caches LIST] [--text F]
          [--codebook-dir out] [--llama-bin DIR] [--qcpp-lib SO] [--qcpp-max-ctx 4096] [--json OUT]
       python3 bench/longctx_peer.py --plot OUT.png RESULT.json [RESULT.json ...]   (the figure)
       python3 bench/longctx_peer.py --table RESULT.json [RESULT.json ...]          (a markdown table)
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import models_peer  # noqa: E402  (model paths, llama.cpp client, SIMD levels, median)

MODELS = models_peer.MODELS
PREFIX = {"smollm2": "smol", "qwen2.5-coder-1.5b": "qwen2.5", "gemma3-270m": "gemma3"}  # codebook file names
N_CTX_TRAIN = {"smollm2": 8192, "qwen2.5-coder-1.5b": 32768, "gemma3-270m": 32768}
DEFAULT_CACHES = "kvpq:fp16,kvpq:b2.5,kvpq:b3.0,llama:f16,llama:q8_0,llama:q4_0,qcpp:uniform_4b,qcpp:turbo_kv_4b"
LLAMA_TYPES = ("f16", "q8_0", "q4_0")
QCPP_LIB = os.path.join(ROOT, "build-quantcpp", "libturboquant.so")  # scripts/build_quantcpp_peer.sh
REF = "kvpq:b2.5"  # the run the ratios are of


# ---- pure parts (tests/python/test_longctx_peer.py) ----

def parse_caches(s):
    """'kvpq:fp16,llama:q4_0' -> [('kvpq', 'fp16'), ('llama', 'q4_0')]; ValueError for an unknown run."""
    out = []
    for item in filter(None, (x.strip() for x in s.split(","))):
        eng, _, cache = item.partition(":")
        ok = ((eng == "kvpq" and (cache in ("fp16", "fp32") or re.fullmatch(r"b\d+(\.\d+)?", cache)))
              or (eng == "llama" and cache in LLAMA_TYPES) or (eng == "qcpp" and re.fullmatch(r"\w+", cache)))
        if not ok:
            raise ValueError(f"unknown run {item!r} (kvpq:fp16|fp32|bN.N, llama:{'|'.join(LLAMA_TYPES)}, qcpp:TYPE)")
        if (eng, cache) in out:
            raise ValueError(f"run {item!r} given twice")
        out.append((eng, cache))
    if not out:
        raise ValueError("--caches names no run")
    return out


def parse_ctx(s):
    """'512,4k,16384' -> [512, 4096, 16384] (k = 1024)."""
    out = []
    for x in filter(None, (x.strip() for x in s.split(","))):
        m = re.fullmatch(r"(\d+)([kK]?)", x)
        if not m or int(m.group(1)) < 1:
            raise ValueError(f"bad context {x!r}")
        out.append(int(m.group(1)) * (1024 if m.group(2) else 1))
    return out


def parse_rounds_at(s):
    """'16384:1,32768:1' -> {16384: 1, 32768: 1}."""
    out = {}
    for x in filter(None, (x.strip() for x in (s or "").split(","))):
        c, _, r = x.partition(":")
        if not r or int(r) < 1:
            raise ValueError(f"bad --rounds-at item {x!r} (CTX:ROUNDS)")
        out[parse_ctx(c)[0]] = int(r)
    return out


def contexts_for(ctxs, n_ctx_train, steps):
    """The contexts a model runs: each cut to n_ctx_train - steps, duplicates dropped, order kept."""
    out = []
    for c in ctxs:
        c = min(c, n_ctx_train - steps)
        if c >= 1 and c not in out:
            out.append(c)
    return out


def round_order(runs, i):
    """Round i's order: as given on even rounds, reversed on odd ones."""
    return list(runs) if i % 2 == 0 else list(runs)[::-1]


median = models_peer.median


def summarize(rounds, ref=REF):
    """Per-run medians over the rounds (each field of the rows) and the ref run's decode / prefill ratios
    to each other run: medians of the per-round ratios (rounds where both ran). rounds: list of
    {label: row or {'error': ...}}."""
    labels = []
    for r in rounds:
        labels += [k for k in r if k not in labels]
    med = {}
    for lab in labels:
        rows = [r[lab] for r in rounds if lab in r and "error" not in r[lab]]
        if not rows:
            med[lab] = {"error": next(r[lab]["error"] for r in rounds if lab in r)}
            continue
        med[lab] = {k: median([x[k] for x in rows]) for k in rows[0] if isinstance(rows[0][k], (int, float))
                    and all(isinstance(x.get(k), (int, float)) for x in rows)}
        med[lab]["n"] = len(rows)
    ratios = {}
    for lab in labels:
        if lab == ref:
            continue
        for field in ("decode_tok_per_s", "prompt_tok_per_s"):
            xs = [r[ref][field] / r[lab][field] for r in rounds if ref in r and lab in r and
                  "error" not in r[ref] and "error" not in r[lab] and r[lab][field] > 0]
            if xs:
                ratios.setdefault(lab, {})[field.split("_")[0]] = median(xs)
        if ref in med and lab in med and "kv_bytes" in med.get(ref, {}) and med[lab].get("kv_bytes"):
            ratios.setdefault(lab, {})["kv_bytes"] = med[ref]["kv_bytes"] / med[lab]["kv_bytes"]
    return med, ratios


def label(eng, cache):
    return f"{eng}:{cache}"


# ---- measurements ----

def run_measured(cmd, env=None):
    """Run cmd to its end; (stdout, stderr, peak RSS bytes of the child from wait4). RuntimeError when it
    fails."""
    e = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    e.update(env or {})
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, env=e)
        _, status, ru = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        o, r = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ...: exit {p.returncode}\n{r[-1500:]}")
    return o, r, ru.ru_maxrss * 1024


def measure(a, name, eng, cache, ctx, ids_file):
    """One run: a row with prompt_tok_per_s, decode_tok_per_s, decode_ms_median, peak_rss_bytes, kv_bytes."""
    model = os.path.join(ROOT, MODELS.get(name, name))
    if eng == "kvpq":
        spec = cache if cache in ("fp16", "fp32") else "vq:" + codebook(a, name, cache)
        out, _, rss = run_measured([a.kvpq, "bench", "decode", "--model", model, "--text", a.text, "--cache", spec,
                                    "--ctx", str(ctx), "--steps", str(a.steps), "--threads", str(a.threads),
                                    "--json", "--quiet"])
        j = json.loads(out)["results"][0]
        return {"prompt_tok_per_s": j["prompt_tok_per_s"], "decode_tok_per_s": j["decode_tok_per_s"],
                "decode_ms_median": j["decode_ms_median"], "decode_ms_mean": j["decode_ms_mean"],
                "peak_rss_bytes": rss, "kv_bytes": j.get("stored_bytes", 0)}
    if eng == "llama":
        out, _, rss = run_measured([models_peer.speed_client(a.llama_bin), model, str(a.threads), "ctx", ids_file,
                                    str(ctx), str(a.steps), cache, cache])
        j = json.loads(out.strip().splitlines()[-1])
        return {"prompt_tok_per_s": j["prompt_tok_per_s"], "decode_tok_per_s": j["decode_tok_per_s"],
                "decode_ms_median": j["decode_ms_median"], "decode_ms_mean": j["decode_ms_mean"],
                "peak_rss_bytes": rss, "kv_bytes": j["state_seq_bytes"]}
    out, err, rss = run_measured([sys.executable, os.path.abspath(__file__), "--qcpp-child", a.qcpp_lib, model,
                                  ids_file, str(ctx), str(a.steps), cache, str(a.threads)])
    j = json.loads(out.strip().splitlines()[-1])
    j["peak_rss_bytes"] = rss
    return j


def codebook(a, name, cache):
    path = os.path.join(a.codebook_dir, f"{PREFIX.get(name, name)}_pq_{cache}.safetensors")
    if not os.path.exists(path):
        raise RuntimeError(f"no codebook {path} (kvpq calibrate --bits {cache[1:]})")
    return path


def qcpp_child(lib_path, model, ids_file, ctx, steps, kv_name, threads):
    """quant.cpp's run in this (child) process: load with its defaults, state of kv_name, the prompt by
    tq_forward_batch (token by token where its engine returns -1), then steps tq_forward calls. Prints
    one JSON line."""
    import ctypes
    L = ctypes.CDLL(lib_path)
    L.tq_load_model.restype, L.tq_load_model.argtypes = ctypes.c_void_p, [ctypes.c_char_p]
    L.tq_create_state_ex.restype = ctypes.c_void_p
    L.tq_create_state_ex.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    L.tq_forward.restype = ctypes.POINTER(ctypes.c_float)
    L.tq_forward.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    L.tq_forward_batch.restype = ctypes.c_int
    L.tq_forward_batch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int), ctypes.c_int,
                                   ctypes.c_int]
    L.tq_set_threads.argtypes = [ctypes.c_int]
    L.tq_type_name.restype = ctypes.c_char_p
    L.tq_set_threads(threads)
    names = [L.tq_type_name(i).decode() for i in range(L.tq_type_count())]
    if kv_name not in names:
        raise SystemExit(f"quant.cpp library {lib_path} has no KV type {kv_name} ({', '.join(names)})")
    ids = [int(x) for x in open(ids_file).read().split()][:ctx + steps]
    if len(ids) < ctx + steps:
        raise SystemExit(f"{ids_file}: {len(ids)} ids, need {ctx + steps}")
    m = L.tq_load_model(model.encode())
    if not m:
        raise SystemExit(f"tq_load_model failed on {model}")
    cfg = ctypes.cast(m, ctypes.POINTER(ctypes.c_int * 8)).contents
    if cfg[7] < ctx + steps:  # max_seq_len, capped at 4096 by its loader; the state is sized from it
        cfg[7] = ctx + steps
    st = L.tq_create_state_ex(m, names.index(kv_name), 0)
    if not st:
        raise SystemExit("tq_create_state_ex failed")
    arr = (ctypes.c_int * ctx)(*ids[:ctx])
    t0 = time.perf_counter()
    rc = L.tq_forward_batch(m, st, arr, ctx, 0)
    batched = rc == ctx
    if not batched:
        for i in range(ctx):
            L.tq_forward(m, st, ids[i], i)
    t_prompt = time.perf_counter() - t0
    dt = []
    for i in range(steps):
        t0 = time.perf_counter()
        L.tq_forward(m, st, ids[ctx + i], ctx + i)
        dt.append(time.perf_counter() - t0)
    med = median(dt)

    class Traits(ctypes.Structure):  # tq_type_traits_t, as bench/quantcpp_peer.py reads it (no numpy here)
        _fields_ = [("name", ctypes.c_char_p), ("block_size", ctypes.c_size_t), ("type_size", ctypes.c_size_t),
                    ("bpe", ctypes.c_float), ("quantize", ctypes.c_void_p), ("dequantize", ctypes.c_void_p),
                    ("attention", ctypes.c_void_p), ("residual_type", ctypes.c_int)]
    t = (Traits * len(names)).in_dll(L, "TQ_TRAITS")[names.index(kv_name)]
    n_layers, n_kv, hd = cfg[0], cfg[4], cfg[5]
    key = -(-hd // t.block_size) * t.type_size  # whole blocks per head (bench/quantcpp_peer.py key_bits)
    kv = n_layers * (ctx + steps) * n_kv * (key + 2 * hd)  # quantized keys, fp16 values
    print(json.dumps({"prompt_tok_per_s": ctx / t_prompt, "decode_tok_per_s": 1 / med, "decode_ms_median": med * 1e3,
                      "decode_ms_mean": sum(dt) / len(dt) * 1e3, "prefill_batched": batched, "kv_bytes": kv}))


def simd_qcpp(lib):
    """quant.cpp's SIMD: its sources have AVX2 (and NEON) kernels, no AVX-512; scripts/build_quantcpp_peer.sh
    compiles with -march=native, so the compiler may use AVX-512 where it vectorizes loops itself."""
    return f"AVX2 kernels, built -march=native ({lib})" if os.path.exists(lib) else f"not found ({lib})"


def available(a, eng):
    """None when the engine can run here, else why not."""
    if eng == "kvpq":
        return None if os.path.exists(a.kvpq) else f"no {a.kvpq}"
    if eng == "llama":
        return None if os.path.exists(os.path.join(a.llama_bin, "libllama.so")) else f"no libllama.so in {a.llama_bin}"
    return None if os.path.exists(a.qcpp_lib) else f"no {a.qcpp_lib} (scripts/build_quantcpp_peer.sh)"


def fmt_row(lab, r):
    if "error" in r:
        return f"    {lab:18s} skipped: {r['error'].splitlines()[0][:100]}"
    return (f"    {lab:18s} prefill {r['prompt_tok_per_s']:8.1f} tok/s  decode {r['decode_tok_per_s']:7.2f} tok/s  "
            f"RSS {r['peak_rss_bytes'] / 2**20:7.1f} MiB" + (f"  KV {r['kv_bytes'] / 2**20:8.2f} MiB" if r.get("kv_bytes")
                                                              else ""))


def bench_model(a, name, runs, ids_file, results):
    res = results.setdefault(name, {"model": MODELS.get(name, name), "contexts": {}})
    n_train = N_CTX_TRAIN.get(name, 32768)
    for ctx in contexts_for(a.ctx, n_train, a.steps):
        todo = [(e, c) for e, c in runs if not (e == "qcpp" and ctx > a.qcpp_max_ctx)]
        reps = a.rounds_at.get(ctx, a.rounds)
        rounds = []
        print(f"{name} ctx {ctx}: {reps} round(s) of {len(todo)} runs, load {os.getloadavg()[0]:.2f}", flush=True)
        for i in range(reps):
            r = {}
            load0 = os.getloadavg()[0]
            for eng, cache in round_order(todo, i):
                lab = label(eng, cache)
                why = available(a, eng)
                try:
                    if why:
                        raise RuntimeError(why)
                    r[lab] = measure(a, name, eng, cache, ctx, ids_file)
                except (RuntimeError, ValueError, KeyError, json.JSONDecodeError) as ex:
                    r[lab] = {"error": str(ex)}
                print(f"  round {i + 1}" + fmt_row(lab, r[lab])[3:], flush=True)
                # after every run: a bench cut short keeps what it measured (the last round maybe partial)
                done = rounds + [{"runs": r, "load_before": load0, "load_after": os.getloadavg()[0],
                                  "order": [label(e, c) for e, c in round_order(todo, i)]}]
                med, ratios = summarize([x["runs"] for x in done])
                skipped = [label(e, c) for e, c in runs if (e, c) not in todo]
                res["contexts"][str(ctx)] = {"ctx": ctx, "steps": a.steps, "rounds": done, "median": med,
                                             "ratios": ratios, "skipped_over_qcpp_max_ctx": skipped}
                if a.json:
                    write_json(a, results)
            rounds = done
        print(f"{name} ctx {ctx}: medians of {reps} round(s)")
        for lab, m in med.items():
            extra = ""
            if lab in ratios and "decode" in ratios[lab]:
                extra = f"   {REF} / this: decode {ratios[lab]['decode']:.2f}x"
                if "kv_bytes" in ratios[lab]:
                    extra += f", KV bytes {ratios[lab]['kv_bytes']:.3f}x"
            print(fmt_row(lab, m) + extra, flush=True)


def write_json(a, results):
    with open(a.json, "w") as f:
        json.dump({"schema": "kvpq.longctx_peer/1", **results, "_run": a.run_info}, f, indent=1)


def load_results(paths):
    """{model: {ctx string: context result}} merged over result JSONs, and their _run records."""
    models, runs = {}, []
    for p in paths:
        d = json.load(open(p))
        runs.append(d.get("_run", {}))
        for name, r in d.items():
            if name.startswith("_") or name == "schema":
                continue
            models.setdefault(name, {}).update(r["contexts"])
    return models, runs


def table(paths):
    """The markdown table of result JSONs: per model, context and run, the medians and kvpq:b2.5's ratios."""
    models, _ = load_results(paths)
    lines = [f"| model | ctx | run | rounds | decode tok/s | prefill tok/s | peak RSS MiB | KV MiB | {REF} decode / this "
             f"| {REF} KV / this |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, ctxs in models.items():
        for c in sorted(ctxs, key=int):
            med, ratios = ctxs[c]["median"], ctxs[c]["ratios"]
            for lab, m in med.items():
                if "error" in m:
                    lines.append(f"| {name} | {c} | {lab} | - | skipped: {m['error'].splitlines()[0][:60]} | | | | | |")
                    continue
                rt = ratios.get(lab, {})
                lines.append(f"| {name} | {c} | {lab} | {m['n']} | {m['decode_tok_per_s']:.2f} | {m['prompt_tok_per_s']:.1f} | "
                             f"{m['peak_rss_bytes'] / 2**20:.0f} | "
                             + (f"{m['kv_bytes'] / 2**20:.2f}" if m.get("kv_bytes") else "-") + " | "
                             + (f"{rt['decode']:.2f}x" if "decode" in rt else "-") + " | "
                             + (f"{rt['kv_bytes']:.3f}x" if "kv_bytes" in rt else "-") + " |")
    return "\n".join(lines)


def plot(out, paths):
    """Decode tok/s against context, a line per run, a panel per model, from result JSONs."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models, _ = load_results(paths)
    fig, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 8.5), squeeze=False)
    style = {"kvpq": "-", "llama": "--", "qcpp": ":"}

    order = [label(e, c) for e, c in parse_caches(DEFAULT_CACHES)]

    def color(lab):  # one colour per run in every panel
        return plt.cm.tab10((order.index(lab) if lab in order else len(order) + hash(lab) % 2) % 10)

    def nice(lab):
        return (lab.replace("llama:", "llama.cpp ").replace("qcpp:", "quant.cpp ").replace("kvpq:b", "kvpq --bits ")
                .replace("kvpq:", "kvpq "))
    for ax, (name, ctxs) in zip(axes[1], models.items()):  # the ratios: same-round pairs, robust to load
        lines = {}
        for c in sorted(ctxs, key=int):
            for lab, r in ctxs[c]["ratios"].items():
                if "decode" in r:
                    lines.setdefault(lab, []).append((int(c), r["decode"]))
        for lab, pts in lines.items():
            xs, ys = zip(*pts)
            ax.plot(xs, ys, style.get(lab.split(":")[0], "-"), marker="o", color=color(lab), label=nice(lab))
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(f"{nice(REF)} decode / this run's (same rounds)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax, (name, ctxs) in zip(axes[0], models.items()):
        lines = {}
        for c in sorted(ctxs, key=int):
            for lab, m in ctxs[c]["median"].items():
                if "error" not in m:
                    lines.setdefault(lab, []).append((int(c), m["decode_tok_per_s"]))
        for lab, pts in lines.items():
            xs, ys = zip(*pts)
            ax.plot(xs, ys, style.get(lab.split(":")[0], "-"), marker="o", color=color(lab), label=nice(lab))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode tok/s (median of rounds)")
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Decode at long context, 2 threads (bench/longctx_peer.py)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--qcpp-child"]:
        lib, model, ids_file, ctx, steps, kv, threads = argv[1:8]
        return qcpp_child(lib, model, ids_file, int(ctx), int(steps), kv, int(threads))
    if argv[:1] == ["--plot"]:
        return plot(argv[1], argv[2:])
    if argv[:1] == ["--table"]:
        print(table(argv[1:]))
        return 0
    a = parse_args(argv)
    runs = parse_caches(a.caches)
    simd_kvpq, simd_llama = models_peer.simd_levels(a) if os.path.exists(a.kvpq) else ("?", "?")
    simd = {"kvpq": simd_kvpq, "llama.cpp": simd_llama, "quant.cpp": simd_qcpp(a.qcpp_lib)}
    print("SIMD: " + "; ".join(f"{k} {v}" for k, v in simd.items()), flush=True)
    up = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"uptime: {up}", flush=True)
    git = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    a.run_info = {"command": " ".join(["bench/longctx_peer.py"] + argv), "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                  "kvpq_commit": git.stdout.strip(), "cpus": os.cpu_count(), "threads": a.threads, "steps": a.steps,
                  "OMP_WAIT_POLICY": "PASSIVE", "simd": simd, "uptime_start": up, "text": a.text,
                  "llama_bin": a.llama_bin, "qcpp_lib": a.qcpp_lib, "ref": REF}
    results = {}
    for name in a.models.split(","):
        model = os.path.join(ROOT, MODELS.get(name, name))
        if available(a, "llama") is None:
            ids = models_peer.ids_of(a.text, model, a.llama_bin, True)
        else:  # kvpq's tokenizer (the same ids: docs/tokenizer.md)
            sys.path.insert(0, os.path.join(ROOT, "python"))
            import kvpq
            mm = kvpq.Model(model)
            ids = list(mm.tokenize(open(a.text, encoding="utf-8").read(), add_bos=bool(mm.info["add_bos"])))
        with tempfile.NamedTemporaryFile("w", suffix=".ids", delete=False) as f:
            f.write(" ".join(map(str, ids)))
        try:
            bench_model(a, name, runs, f.name, results)
        finally:
            os.unlink(f.name)
    a.run_info["uptime_end"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"uptime: {a.run_info['uptime_end']}")
    if a.json:
        write_json(a, results)
    return 0


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,qwen2.5-coder-1.5b")
    ap.add_argument("--ctx", type=parse_ctx, default=parse_ctx("512,4096,16384,32768"))
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rounds-at", type=parse_rounds_at, default={}, help="CTX:ROUNDS,... per-context rounds")
    ap.add_argument("--caches", default=DEFAULT_CACHES)
    ap.add_argument("--text", default=os.path.join(ROOT, "data", "text", "persuasion.txt"))
    ap.add_argument("--codebook-dir", default=os.path.join(ROOT, "out"))
    ap.add_argument("--llama-bin", default=models_peer.LLAMA_BIN)
    ap.add_argument("--kvpq", default=os.path.join(ROOT, "build", "kvpq"))
    ap.add_argument("--qcpp-lib", default=QCPP_LIB)
    ap.add_argument("--qcpp-max-ctx", type=int, default=4096,
                    help="quant.cpp runs only up to this context (its prefill is slow on 2 cores)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    try:
        parse_caches(a.caches)
    except ValueError as ex:
        ap.error(str(ex))
    if a.steps < 1 or a.threads < 1 or a.rounds < 1:
        ap.error("--steps, --threads and --rounds must be >= 1")
    return a


if __name__ == "__main__":
    sys.exit(main())
