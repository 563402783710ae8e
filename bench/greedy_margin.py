#!/usr/bin/env python3
"""greedy_margin.py — where kvpq's and llama.cpp's greedy tokens part, and whether that is a near-tie.

For one model and the prompt of bench/models_peer.py (token ids from llama-tokenize, so the tokenizers
cannot differ), both run greedy decoding and print, per step, the chosen token and the two largest
logits: kvpq through its Python package (fp32 KV cache, or --cache), llama.cpp through a small client
of its libllama (bench/llama_cpp_greedy_logits.c, compiled here against the peer's build). Then, at the
first step where the chosen tokens differ, each side's top-2 margin and both tokens' logits on each side.
A margin far below the logit difference between the two implementations elsewhere (their max |diff| on
the shared steps, printed too) is a near-tie that either arithmetic may break either way.

usage: python3 bench/greedy_margin.py [--model smollm2|PATH] [-n 32] [--threads 2] [--cache fp32]
       (needs KVPQ_LIB=build/libkvpq_model.so and PYTHONPATH=python, as ctest sets them)
"""
import argparse
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import models_peer  # noqa: E402

LLAMA = os.path.dirname(os.path.dirname(models_peer.LLAMA_BIN))  # .../llama.cpp


def llama_client(out_dir):
    exe = os.path.join(out_dir, "llama_cpp_greedy_logits")
    src = os.path.join(ROOT, "bench", "llama_cpp_greedy_logits.c")
    if not os.path.exists(exe) or os.path.getmtime(exe) < os.path.getmtime(src):
        subprocess.run(["cc", "-O2", "-I", f"{LLAMA}/include", "-I", f"{LLAMA}/ggml/include", src, "-L",
                        models_peer.LLAMA_BIN, "-lllama", f"-Wl,-rpath,{models_peer.LLAMA_BIN}", "-o", exe], check=True)
    return exe


def llama_steps(exe, model, ids, n, threads):
    out = subprocess.run([exe, model, str(n), str(threads), ",".join(map(str, ids))], capture_output=True, text=True,
                         check=True, env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE")).stdout
    rows = [line.split() for line in out.splitlines() if line.strip()]
    return [(int(r[1]), int(r[2]), float(r[3]), int(r[4]), float(r[5])) for r in rows]


def kvpq_steps(model, ids, n, threads, cache, follow=None):
    """Greedy steps of kvpq: (token, top1, l1, top2, l2, logits). With follow (a token list), feed
    those tokens instead of kvpq's own choice (to compare logits on the same context)."""
    import kvpq
    m = kvpq.Model(model, n_threads=threads)
    c = m.new_cache(cache, max_seq=len(ids) + n + 1)
    lg = m.eval(c, np.asarray(ids, np.int32))
    steps = []
    for s in range(n):
        o = np.argsort(lg)[::-1][:2]
        steps.append((int(o[0]), int(o[0]), float(lg[o[0]]), int(o[1]), float(lg[o[1]]), lg.copy()))
        nxt = follow[s] if follow is not None and s < len(follow) else int(o[0])
        lg = m.eval(c, np.asarray([nxt], np.int32))
    return steps


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", default="fp32")
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    a = ap.parse_args()
    model = os.path.join(ROOT, models_peer.MODELS.get(a.model, a.model))
    try:
        ids = models_peer.ids_of(models_peer.PROMPT, model, models_peer.LLAMA_BIN, False)
    except RuntimeError:  # no working llama-tokenize: kvpq's ids (equal to it, tests/test_tokenizer_golden.c)
        import kvpq
        m = kvpq.Model(model)
        ids = [int(t) for t in m.tokenize(models_peer.PROMPT, add_bos=bool(m.info["add_bos"]))]
    ls = llama_steps(llama_client(a.build), model, ids, a.n, a.threads)
    lt = [s[0] for s in ls]
    ks = kvpq_steps(model, ids, a.n, a.threads, a.cache, follow=lt)  # kvpq on llama.cpp's tokens
    print(f"model {os.path.basename(model)}, prompt ids {ids}, kvpq cache {a.cache}")
    print("step | llama.cpp top1 (logit) top2 (logit) margin | kvpq on the same context: top1 top2 margin | "
          "kvpq logit of llama.cpp's token")
    first = None
    for s, (l, k) in enumerate(zip(ls, ks)):
        mark = "" if l[0] == k[0] else "  <-- differ"
        if mark and first is None:
            first = s
        print(f"{s:4d} | {l[1]:6d} ({l[2]:9.4f}) {l[3]:6d} ({l[4]:9.4f}) {l[2] - l[4]:7.4f} | {k[1]:6d} ({k[2]:9.4f}) "
              f"{k[3]:6d} ({k[4]:9.4f}) {k[2] - k[4]:7.4f} | {k[5][l[0]]:9.4f}{mark}")
    # How far the two implementations' logits of the same tokens lie apart, on the chosen tokens.
    d = [abs(k[5][l[1]] - l[2]) for l, k in zip(ls, ks)] + [abs(k[5][l[3]] - l[4]) for l, k in zip(ls, ks)]
    print(f"|kvpq - llama.cpp| on the logits of llama.cpp's top-2 tokens, all {len(ls)} steps: max {max(d):.4f}, "
          f"median {float(np.median(d)):.4f}")
    if first is None:
        print(f"greedy tokens identical for {len(ls)} steps")
    else:
        l, k = ls[first], ks[first]
        print(f"first difference at step {first}: llama.cpp picks {l[0]} (margin {l[2] - l[4]:.4f} over {l[3]}), "
              f"kvpq picks {k[0]} (margin {k[2] - k[4]:.4f} over {k[3]}); kvpq's logits of the two: "
              f"{k[5][k[0]]:.4f} / {k[5][l[0]]:.4f}")


if __name__ == "__main__":
    sys.exit(main())
