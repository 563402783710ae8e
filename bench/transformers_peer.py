#!/usr/bin/env python3
"""transformers_peer.py — kvpq inside Hugging Face transformers, beside transformers' own caches.

transformers (PyPI) loads SmolLM2-135M from its GGUF file (from_pretrained(dir, gguf_file=...),
weights dequantized to float32 by the `gguf` package) and runs on the CPU. Prints one table:
  * logits of the first --positions tokens: transformers (SDPA, no cache) against kvpq's own engine
    (kvpq.Model, fp32 cache) on the same token ids: max |diff| and argmax agreement;
  * perplexity with kvpq.transformers.KVPQCache (attention from codes) against `kvpq ppl --cache
    vq:CODEBOOK` on the same codebook, text, context and chunks (llama.cpp's scoring, token ids from
    kvpq's tokenizer for both), and transformers' own with DynamicCache;
  * a long generation (--gen-ctx tokens of text prefilled in chunks of 256, then --gen greedy tokens)
    with DynamicCache, KVPQCache and QuantizedCache (quanto backend, 4 and 2 bits, residual 128), each
    in its own process: the cache's bytes at the end, the bytes per token the cache adds between
    half and full context (the coded tokens' cost for KVPQCache), the process's peak RSS growth
    during the run, and prefill / decode tokens/s.

usage: python3 bench/transformers_peer.py --codebook CB.safetensors [--text F] [--ctx 512] [--chunks 2]
           [--positions 32] [--gen-ctx 4096] [--gen 32] [--caches dynamic,kvpq,quanto4,quanto2]
           [--threads 2] [--json OUT]
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
if os.path.join(ROOT, "python") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "python"))

MODEL_DIR = os.path.join(ROOT, "models")
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_hf(threads):
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(threads)
    import transformers.utils.logging as tl
    tl.set_verbosity_error()
    tl.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(MODEL_DIR, gguf_file=MODEL_FILE, dtype=torch.float32).eval()


def tensor_bytes(obj, seen=None):
    """Bytes of every tensor reachable from a cache layer's attributes (tensor subclasses such as
    quanto's packed tensors through __tensor_flatten__)."""
    import torch
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
            names, _ = obj.__tensor_flatten__()
            return sum(tensor_bytes(getattr(obj, n), seen) for n in names)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(x, seen) for x in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(x, seen) for x in obj.values())
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith(("transformers", "optimum", "hqq")):
        return sum(tensor_bytes(x, seen) for k, x in vars(obj).items() if k not in ("owner", "config"))
    return 0


def cache_bytes(cache):
    from kvpq.transformers import KVPQCache
    if isinstance(cache, KVPQCache):
        return cache.resident_bytes
    return sum(tensor_bytes(layer) for layer in cache.layers)


def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))


def make_cache(kind, model, codebook):
    from transformers import DynamicCache, QuantizedCache
    if kind == "dynamic":
        return DynamicCache(config=model.config)
    if kind == "kvpq":
        import kvpq
        from kvpq.transformers import KVPQCache
        return KVPQCache(kvpq.Codebook.load(codebook), model)
    if kind.startswith("quanto"):
        return QuantizedCache(backend="quanto", config=model.config, nbits=int(kind[6:]), q_group_size=64,
                              residual_length=128)
    raise SystemExit(f"unknown cache '{kind}'")


def gen_one(a):
    """One cache kind's long generation (run in a child process so peak RSS is its own)."""
    import torch
    import kvpq
    model = load_hf(a.threads)
    if a.cache != "kvpq":
        model.set_attn_implementation("sdpa")
    ids = kvpq.Vocab(os.path.join(MODEL_DIR, MODEL_FILE)).tokenize(open(a.text, encoding="utf-8").read())
    ids = torch.from_numpy(ids[: a.gen_ctx].astype(np.int64))[None]
    cache = make_cache(a.cache, model, a.codebook)
    # peak RSS of the run alone: loading the model (GGUF dequantization) peaks higher than anything
    # after it, so the high-water mark is reset here (Linux: clear_refs 5 resets VmHWM)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    rss0 = rss_kib()
    half = None
    with torch.no_grad():
        t0 = time.perf_counter()
        for p0 in range(0, ids.shape[1], 256):
            logits = model(ids[:, p0:p0 + 256], past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            if half is None and p0 + 256 >= ids.shape[1] // 2:
                half = (p0 + 256, cache_bytes(cache))
        t_pre = time.perf_counter() - t0
        full = (ids.shape[1], cache_bytes(cache))
        tok = logits[:, -1].argmax(-1, keepdim=True)
        out = []
        t0 = time.perf_counter()
        for _ in range(a.gen):
            logits = model(tok, past_key_values=cache, use_cache=True).logits
            tok = logits[:, -1].argmax(-1, keepdim=True)
            out.append(int(tok))
        t_dec = time.perf_counter() - t0
    with open("/proc/self/status") as f:
        peak = next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))
    res = {"cache": a.cache, "tokens": ids.shape[1] + a.gen, "cache_bytes": cache_bytes(cache),
           "bytes_per_token_added": (full[1] - half[1]) / (full[0] - half[0]),
           "peak_rss_growth_mib": (peak - rss0) / 1024, "prefill_tok_s": ids.shape[1] / t_pre,
           "decode_tok_s": a.gen / t_dec, "generated": out}
    print(json.dumps(res))


def ppl_hf(model, cache_fn, chunks):
    """Perplexity as `kvpq ppl` computes it: each chunk from an empty cache, evaluated as two calls,
    positions [0, n/2) (no logits needed) then [n/2, n) (scored), as tools/cmd_ppl.c's eval_chunk
    does with its default --batch. The split matters for a VQ cache: during the first call the
    first half is still inside the float window; a single call would code it before its own
    queries attend."""
    import torch
    from llama_cpp_peer import ppl_with_stderr, score_chunk
    nll = []
    with torch.no_grad():
        for ch in chunks:
            cache, first = cache_fn(), len(ch) // 2
            model(torch.tensor([ch[:first]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
            logits = model(torch.tensor([ch[first:]]), past_key_values=cache, use_cache=True).logits[0].numpy()
            full = np.zeros((len(ch), logits.shape[-1]), np.float32)  # score_chunk reads rows n/2 .. n-2
            full[first:] = logits
            nll += score_chunk(full, ch)
    return ppl_with_stderr(nll)


def ppl_part(a):
    """Logits and perplexity rows of the table (one process: transformers and kvpq's engine)."""
    import torch
    import kvpq
    from kvpq.transformers import KVPQCache
    from llama_cpp_peer import chunks_of
    model = load_hf(a.threads)
    model.set_attn_implementation("sdpa")
    eng = kvpq.Model(os.path.join(MODEL_DIR, MODEL_FILE), n_threads=a.threads)
    info = eng.info
    text = open(a.text, encoding="utf-8").read()
    tokens = eng.tokenize(text, add_bos=bool(info["add_bos"])).tolist()
    res, rows = {}, []

    # logits: transformers vs kvpq's engine
    probe = tokens[: a.positions]
    with torch.no_grad():
        hf = model(torch.tensor([probe])).logits[0].numpy()
    ours = eng.eval(eng.new_cache("fp32", a.positions), np.array(probe, np.int32), logits_all=True)
    d = float(np.abs(hf - ours).max())
    agree = float((hf.argmax(-1) == ours.argmax(-1)).mean())
    res.update(logits_max_abs_diff=d, logits_argmax_agree=agree, logits_max_abs=float(np.abs(ours).max()))
    rows.append((f"logits, first {a.positions} tokens: max |diff| (max |logit| {np.abs(ours).max():.1f})",
                 "0 (reference)", f"{d:.2e}", f"argmax agree {agree:.3f}"))

    # perplexity: KVPQCache vs kvpq ppl (same codebook, text, ctx, chunks)
    chunks = chunks_of(tokens, a.ctx, a.chunks, info["bos_id"], info["add_bos"])
    cb = kvpq.Codebook.load(a.codebook)
    t0 = time.perf_counter()
    ppl_vq, se_vq = ppl_hf(model, lambda: KVPQCache(cb, model), chunks)
    t_vq = time.perf_counter() - t0
    model.set_attn_implementation("sdpa")
    from transformers import DynamicCache
    ppl_dyn, se_dyn = ppl_hf(model, lambda: DynamicCache(config=model.config), chunks)
    bin_ = os.environ.get("KVPQ_BIN", os.path.join(ROOT, "build", "kvpq"))
    p = subprocess.run([bin_, "ppl", "--model", os.path.join(MODEL_DIR, MODEL_FILE), "--text", a.text, "--ctx",
                        str(a.ctx), "--chunks", str(a.chunks), "--threads", str(a.threads), "--json", "--cache",
                        f"fp32,vq:{a.codebook}"], capture_output=True, text=True, check=True)
    cli_fp32, cli_vq = json.loads(p.stdout)["results"]
    # the noise floor of this comparison: the engine against itself when only the rounding of its
    # forward pass changes (another SIMD level), which moves keys by ~1 ulp and flips a few codes
    simd = {}
    for level in ("avx2", "scalar"):
        q = subprocess.run([bin_, "ppl", "--model", os.path.join(MODEL_DIR, MODEL_FILE), "--text", a.text, "--ctx",
                            str(a.ctx), "--chunks", str(a.chunks), "--threads", str(a.threads), "--json", "--cache",
                            f"vq:{a.codebook}"], capture_output=True, text=True, env={**os.environ, "KVPQ_SIMD": level})
        if q.returncode == 0:
            simd[level] = json.loads(q.stdout)["results"][0]["ppl"]
    rel = ppl_vq / cli_vq["ppl"] - 1
    res.update(ppl_kvpqcache=ppl_vq, ppl_cli_vq=cli_vq["ppl"], ppl_rel_diff=rel, ppl_dynamic=ppl_dyn,
               ppl_cli_fp32=cli_fp32["ppl"], ppl_kvpqcache_seconds=t_vq)
    rows.append((f"ppl ctx {a.ctx} x {len(chunks)} chunks, vq codebook", f"{cli_vq['ppl']:.4f} (kvpq ppl)",
                 f"{ppl_vq:.4f} (KVPQCache)", f"{100 * rel:+.3f}%"))
    for level, v in simd.items():
        rows.append((f"ppl, same codebook, kvpq engine at SIMD level {level}", f"{cli_vq['ppl']:.4f} (default)",
                     f"{v:.4f} (kvpq {level})", f"{100 * (v / cli_vq['ppl'] - 1):+.3f}%"))
    res["ppl_cli_vq_simd"] = simd
    rows.append(("ppl, uncompressed", f"{cli_fp32['ppl']:.4f} (kvpq fp32)", f"{ppl_dyn:.4f} (DynamicCache)",
                 f"{100 * (ppl_dyn / cli_fp32['ppl'] - 1):+.3f}%"))
    return res, rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--codebook", required=True)
    ap.add_argument("--text", default=os.path.join(ROOT, "data", "text", "persuasion.txt"))
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--positions", type=int, default=32)
    ap.add_argument("--gen-ctx", type=int, default=4096)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--caches", default="dynamic,kvpq,quanto4,quanto2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("--skip-gen", action="store_true")
    ap.add_argument("--skip-ppl", action="store_true", help="only the generation table")
    ap.add_argument("--cache", help=argparse.SUPPRESS)  # child process: one generation
    a = ap.parse_args()
    if a.cache:
        return gen_one(a)

    res, rows = ({}, []) if a.skip_ppl else ppl_part(a)

    gens = []
    if not a.skip_gen:
        for kind in a.caches.split(","):
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--cache", kind, "--codebook", a.codebook,
                                "--text", a.text, "--gen-ctx", str(a.gen_ctx), "--gen", str(a.gen), "--threads",
                                str(a.threads)], capture_output=True, text=True)
            if p.returncode != 0:
                gens.append({"cache": kind, "error": p.stderr.strip().splitlines()[-1] if p.stderr else "failed"})
                continue
            gens.append(json.loads(p.stdout.strip().splitlines()[-1]))
        res["generation"] = gens

    print(f"model {MODEL_FILE} (transformers from GGUF, float32, CPU, {a.threads} threads), codebook "
          f"{os.path.basename(a.codebook)}, text {os.path.basename(a.text)}")
    print(f"{'quantity':58s} {'kvpq engine':>22s} {'transformers':>22s} {'diff':>18s}")
    for q, x, y, z in rows:
        print(f"{q:58s} {x:>22s} {y:>22s} {z:>18s}")
    if gens:
        base = next((g for g in gens if g["cache"] == "dynamic" and "error" not in g), None)
        print(f"\ngeneration: {a.gen_ctx} tokens of text prefilled (chunks of 256), then {a.gen} greedy tokens")
        print(f"{'cache':10s} {'cache MiB':>10s} {'vs dyn':>7s} {'B/token':>9s} {'vs dyn':>7s} {'peak RSS +MiB':>14s} "
              f"{'prefill tok/s':>14s} {'decode tok/s':>13s} {'vs dyn':>7s}")
        for g in gens:
            if "error" in g:
                print(f"{g['cache']:10s} failed: {g['error']}")
                continue
            r = (lambda k: f"{g[k] / base[k]:.3f}") if base else (lambda k: "-")
            print(f"{g['cache']:10s} {g['cache_bytes'] / 2**20:10.2f} {r('cache_bytes'):>7s} "
                  f"{g['bytes_per_token_added']:9.0f} {r('bytes_per_token_added'):>7s} {g['peak_rss_growth_mib']:14.1f} "
                  f"{g['prefill_tok_s']:14.1f} {g['decode_tok_s']:13.2f} {r('decode_tok_s'):>7s}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
