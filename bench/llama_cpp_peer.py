#!/usr/bin/env python3
"""llama_cpp_peer.py — kvpq's forward pass beside peers it did not write.

Peers:
  * llama.cpp, through llama-cpp-python (PyPI), when it is installed: perplexity over the same
    text and context (llama.cpp's perplexity scoring: non-overlapping chunks of --ctx tokens, each
    starting fresh, only the second half of each chunk scored), logits of the first positions, and
    prefill / decode tokens/s with the same thread count.
  * an independent numpy reference forward pass written here over the PyPI `gguf` package's
    dequantization (always): logits of the first positions.

kvpq is driven through the kvpq Python package (python/kvpq; KVPQ_LIB or build/libkvpq.so of a checkout).
Prints one table; `--json` writes the numbers as JSON too.

usage: python3 bench/llama_cpp_peer.py [--model M] [--text F] [--ctx 512] [--chunks 4]
                                       [--positions 32] [--threads 2] [--json OUT]
"""
import argparse
import json
import math
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---- kvpq through its Python package ---------------------------------------------------------------

if os.path.join(ROOT, "python") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "python"))  # a checkout's python/kvpq when not pip-installed


class Kvpq:
    """The few kvpq calls this benchmark needs, over kvpq.Model (the package sets OPENBLAS_CORETYPE
    before it loads the library, as the CLI does). lib_path: libkvpq.so to load (KVPQ_LIB)."""

    def __init__(self, lib_path, model_path, n_threads):
        if lib_path:
            os.environ.setdefault("KVPQ_LIB", lib_path)
        import kvpq
        self.kvpq = kvpq
        self.model = kvpq.Model(model_path, n_threads=n_threads)
        from types import SimpleNamespace
        self.info = SimpleNamespace(**self.model.info)

    def tokenize(self, text, add_bos):
        return self.model.tokenize(text, add_bos=bool(add_bos)).tolist()

    def new_cache(self, max_seq, cache_type="fp32"):
        return self.model.new_cache(cache_type, max_seq)

    def eval(self, cache, tokens, logits_all):
        out = self.model.eval(cache, np.asarray(tokens, dtype=np.int32), logits_all)
        return out if logits_all else out[None, :]


# ---- llama.cpp's perplexity scoring (examples/perplexity), shared by both engines ----------------


def score_chunk(logits, chunk):
    """NLLs of chunk[j+1] given logits[j] for j in [n/2, n-1) (llama.cpp: first = n_ctx/2)."""
    n = len(chunk)
    first = n // 2
    out = []
    for j in range(first, n - 1):
        row = logits[j].astype(np.float64)
        mx = row.max()
        lse = mx + math.log(np.exp(row - mx).sum())
        out.append(lse - row[chunk[j + 1]])
    return out


def ppl_with_stderr(nll):
    """Mean-NLL perplexity and its standard error as llama.cpp prints them."""
    nll = np.asarray(nll, dtype=np.float64)
    mean = nll.mean()
    var = (nll * nll).mean() - mean * mean
    ppl = math.exp(mean)
    return ppl, (math.sqrt(var / (len(nll) - 1)) * ppl if var > 0 else float("nan"))


def chunks_of(tokens, ctx, n_chunks, bos, add_bos):
    n = min(n_chunks, len(tokens) // ctx)
    out = []
    for i in range(n):
        c = list(tokens[i * ctx:(i + 1) * ctx])
        if add_bos:
            c[0] = bos
        out.append(c)
    return out


# ---- independent numpy reference forward pass ----------------------------------------------------


class NumpyLlama:
    """A plain numpy Llama forward pass over weights dequantized by the `gguf` package."""

    def __init__(self, path):
        from gguf import GGUFReader
        from gguf.quants import dequantize
        r = GGUFReader(path)

        def field(key, default=None):
            f = r.fields.get(key)
            return default if f is None else f.contents()

        arch = field("general.architecture")
        self.n_layer = int(field(f"{arch}.block_count"))
        self.n_head = int(field(f"{arch}.attention.head_count"))
        self.n_head_kv = int(field(f"{arch}.attention.head_count_kv", self.n_head))
        self.n_embd = int(field(f"{arch}.embedding_length"))
        self.head_dim = self.n_embd // self.n_head
        self.n_rot = int(field(f"{arch}.rope.dimension_count", self.head_dim))
        self.base = float(field(f"{arch}.rope.freq_base", 10000.0))
        self.eps = float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5))
        # llama.cpp's LLAMA_ROPE_TYPE_NEOX architectures rotate (i, i + n_rot/2) pairs; Llama's GGUF
        # files permute Q/K rows so that adjacent pairs (i, i + 1) rotate
        self.neox = arch in ("qwen2",)
        self.w = {}
        for t in r.tensors:
            # dequantize gives numpy shape (rows, cols) = reversed ggml ne
            self.w[t.name] = dequantize(t.data, t.tensor_type).reshape([int(x) for x in reversed(t.shape)]).astype(
                np.float32)
        if "output.weight" not in self.w:
            self.w["output.weight"] = self.w["token_embd.weight"]

    def rmsnorm(self, x, w):
        return (x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + self.eps)).astype(np.float32) * w

    def rope(self, x, pos):
        # x: (n, heads, head_dim); pair i rotates by angle pos * base^(-2i/n_rot); pairs are adjacent
        # (2i, 2i + 1) (GGUF-permuted Q/K rows) or, for NEOX, (i, i + n_rot/2). rope(x, -pos) undoes it.
        half = self.n_rot // 2
        inv = self.base ** (-2.0 * np.arange(half) / self.n_rot)
        ang = pos[:, None] * inv[None, :]  # (n, half)
        c = np.cos(ang)[:, None, :].astype(np.float32)
        s = np.sin(ang)[:, None, :].astype(np.float32)
        x = x.copy()
        i0, i1 = (slice(0, half), slice(half, self.n_rot)) if self.neox else (slice(0, self.n_rot, 2), slice(1, self.n_rot, 2))
        x0 = x[..., i0].copy()
        x1 = x[..., i1].copy()
        x[..., i0] = x0 * c - x1 * s
        x[..., i1] = x0 * s + x1 * c
        return x

    def proj(self, h, p, name):
        """h @ W^T (+ bias where the GGUF has one: Qwen2's q, k, v)."""
        y = h @ self.w[p + name + ".weight"].T
        b = self.w.get(p + name + ".bias")
        return y if b is None else y + b

    def forward(self, tokens, collect=None, hook=None):
        """Logits (n, n_vocab) of tokens at positions 0..n-1. collect: a list that gets one (k, v, q)
        per layer, post-RoPE keys and values (n, n_head_kv, head_dim) and queries (n, n_head,
        head_dim). hook(layer, k, v) -> (k, v): replaces what the layer attends over (after collect)."""
        n = len(tokens)
        w = self.w
        hd, H, Hk = self.head_dim, self.n_head, self.n_head_kv
        x = w["token_embd.weight"][np.asarray(tokens)]
        pos = np.arange(n, dtype=np.float64)
        mask = np.triu(np.full((n, n), -np.inf, dtype=np.float32), 1)
        for l in range(self.n_layer):
            p = f"blk.{l}."
            h = self.rmsnorm(x, w[p + "attn_norm.weight"])
            q = self.rope(self.proj(h, p, "attn_q").reshape(n, H, hd), pos)
            k = self.rope(self.proj(h, p, "attn_k").reshape(n, Hk, hd), pos)
            v = self.proj(h, p, "attn_v").reshape(n, Hk, hd)
            if collect is not None:
                collect.append((k, v, q))
            if hook is not None:
                k, v = hook(l, k, v)
            g = H // Hk
            att = np.empty((n, H, hd), dtype=np.float32)
            for hh in range(H):
                s = q[:, hh, :] @ k[:, hh // g, :].T / math.sqrt(hd) + mask
                s = np.exp(s - s.max(-1, keepdims=True))
                s /= s.sum(-1, keepdims=True)
                att[:, hh, :] = s @ v[:, hh // g, :]
            x = x + att.reshape(n, H * hd) @ w[p + "attn_output.weight"].T
            h = self.rmsnorm(x, w[p + "ffn_norm.weight"])
            gt = h @ w[p + "ffn_gate.weight"].T
            up = h @ w[p + "ffn_up.weight"].T
            x = x + (gt / (1 + np.exp(-gt)) * up) @ w[p + "ffn_down.weight"].T
        return self.rmsnorm(x, w["output_norm.weight"]) @ w["output.weight"].T


# ---- main ------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--text", default=os.path.join(ROOT, "data/text/persuasion.txt"))
    ap.add_argument("--lib", default=os.environ.get("KVPQ_LIB", os.path.join(ROOT, "build/libkvpq.so")))
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--positions", type=int, default=32, help="positions whose logits are compared")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode", type=int, default=64, help="tokens decoded one at a time for the decode speed")
    ap.add_argument("--llama-extra-bufts", action="store_true",
                    help="let llama.cpp use AMX / repacked weights (off: SIGILL on CPUs without AMX enabled)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved speed rounds (median reported)")
    ap.add_argument("--json", help="also write the numbers to this JSON file")
    a = ap.parse_args()

    res = {"model": a.model, "text": a.text, "ctx": a.ctx, "threads": a.threads}
    kv = Kvpq(a.lib, a.model, a.threads)
    text = open(a.text, encoding="utf-8").read()
    tokens = kv.tokenize(text, kv.info.add_bos)
    res["text_tokens"] = len(tokens)
    P = a.positions
    probe = tokens[:P]

    rows = []  # (quantity, kvpq, peer, comparison)

    # logits of the first positions: kvpq vs numpy reference
    c = kv.new_cache(max(a.ctx, P) + a.decode + 8)
    ours = kv.eval(c, probe, True)
    ref = NumpyLlama(a.model).forward(probe)
    d = float(np.abs(ours - ref).max())
    res["logits_maxabs_vs_numpy"] = d
    res["argmax_agree_vs_numpy"] = float((ours.argmax(-1) == ref.argmax(-1)).mean())
    rows.append((f"logits[0:{P}] max |diff| vs numpy reference", "", "", f"{d:.2e}"))
    rows.append(("argmax agreement vs numpy reference", "", "", f"{res['argmax_agree_vs_numpy']:.3f}"))

    # perplexity (ours)
    chunks = chunks_of(tokens, a.ctx, a.chunks, kv.info.bos_id, kv.info.add_bos)
    nll = []
    t0 = time.perf_counter()
    for ch in chunks:
        c.truncate(0)
        nll += score_chunk(kv.eval(c, ch, True), ch)
    t_ours = time.perf_counter() - t0
    ppl, se = ppl_with_stderr(nll)
    res.update(ppl_kvpq=ppl, ppl_kvpq_stderr=se, scored_tokens=len(nll))

    def speed_ours():
        """Prefill of one chunk (last logits only), then greedy decode one token at a time."""
        c.truncate(0)
        t0 = time.perf_counter()
        last = kv.eval(c, chunks[0], False)
        pre = len(chunks[0]) / (time.perf_counter() - t0)
        tok = int(last.argmax())
        t0 = time.perf_counter()
        for _ in range(a.decode):
            tok = int(kv.eval(c, [tok], False).argmax())
        return pre, a.decode / (time.perf_counter() - t0)

    try:
        import llama_cpp  # noqa: F401
        have_llama = True
    except ImportError as e:
        have_llama = False
        res["llama_cpp"] = f"not available: {e}"
    if have_llama:
        import llama_cpp
        import llama_cpp.llama
        from llama_cpp import Llama
        if not a.llama_extra_bufts:
            # llama.cpp's "extra buffer types" (AMX tiles, weight repacking) die with SIGILL on
            # this VM (the CPU reports AMX, the kernel does not enable it); llama-cpp-python has no
            # argument for it, so switch it off in the default model params it starts from.
            orig = llama_cpp.llama_model_default_params

            def no_extra_bufts():
                p = orig()
                p.use_extra_bufts = False
                return p

            llama_cpp.llama_model_default_params = no_extra_bufts
            llama_cpp.llama.llama_cpp.llama_model_default_params = no_extra_bufts
        llm = Llama(model_path=a.model, n_ctx=a.ctx, n_batch=a.ctx, n_ubatch=a.ctx, n_threads=a.threads,
                    n_threads_batch=a.threads, logits_all=True, verbose=False)
        lt = llm.tokenize(text.encode(), add_bos=bool(kv.info.add_bos), special=False)
        res["tokens_equal_llama_cpp"] = lt == tokens

        def lc_eval(toks):
            llm.reset()  # the next eval removes every cached position from n_tokens = 0 on
            llm.eval(toks)
            return np.array(llm.scores[:len(toks)], dtype=np.float32)

        lref = lc_eval(probe)
        d2 = float(np.abs(ours - lref).max())
        res["logits_maxabs_vs_llama_cpp"] = d2
        res["logits_maxabs_numpy_vs_llama_cpp"] = float(np.abs(ref - lref).max())
        res["argmax_agree_vs_llama_cpp"] = float((ours.argmax(-1) == lref.argmax(-1)).mean())
        rows.append((f"logits[0:{P}] max |diff| vs llama.cpp (|logit| max {np.abs(lref).max():.1f})", "", "",
                     f"{d2:.2e}"))
        rows.append(("numpy reference vs llama.cpp, same", "", "", f"{res['logits_maxabs_numpy_vs_llama_cpp']:.2e}"))
        rows.append(("argmax agreement vs llama.cpp", "", "", f"{res['argmax_agree_vs_llama_cpp']:.3f}"))
        t0 = time.perf_counter()
        nll2 = []
        for ch in chunks:
            nll2 += score_chunk(lc_eval(ch), ch)
        t_lc = time.perf_counter() - t0
        ppl2, se2 = ppl_with_stderr(nll2)
        res.update(ppl_llama_cpp=ppl2, ppl_llama_cpp_stderr=se2)
        rows.append((f"perplexity ctx {a.ctx}, {len(chunks)} chunks", f"{ppl:.4f} +/- {se:.4f}",
                     f"{ppl2:.4f} +/- {se2:.4f}", f"{(ppl / ppl2 - 1) * 100:+.3f} %"))
        rows.append((f"ppl pass, all logits, tok/s", f"{len(chunks) * a.ctx / t_ours:.1f}",
                     f"{len(chunks) * a.ctx / t_lc:.1f}", f"{t_lc / t_ours:.2f}x"))
        del llm
        # speed: a context that only returns the last logits, as kvpq's prefill does
        llm = Llama(model_path=a.model, n_ctx=a.ctx + a.decode + 8, n_batch=a.ctx, n_ubatch=a.ctx,
                    n_threads=a.threads, n_threads_batch=a.threads, logits_all=False, verbose=False)

        def last_logits():
            # the newest token's logits straight from the context (llm.scores only has n_batch rows here)
            ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
            return np.ctypeslib.as_array(ptr, shape=(kv.info.n_vocab,))

        def speed_lc():
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(chunks[0])
            pre = len(chunks[0]) / (time.perf_counter() - t0)
            tok = int(np.argmax(last_logits()))
            t0 = time.perf_counter()
            for _ in range(a.decode):
                llm.eval([tok])
                tok = int(np.argmax(last_logits()))
            return pre, a.decode / (time.perf_counter() - t0)

        # interleaved rounds, median: the machine is shared, so both see the same load
        so, sl = [], []
        for _ in range(a.rounds):
            so.append(speed_ours())
            sl.append(speed_lc())
        pre_ours, dec_ours = float(np.median([x[0] for x in so])), float(np.median([x[1] for x in so]))
        pre_lc, dec_lc = float(np.median([x[0] for x in sl])), float(np.median([x[1] for x in sl]))
        res.update(prefill_tok_s_kvpq=pre_ours, decode_tok_s_kvpq=dec_ours, prefill_tok_s_llama_cpp=pre_lc,
                   decode_tok_s_llama_cpp=dec_lc, speed_rounds=a.rounds)
        rows.append((f"prefill tok/s ({len(chunks[0])} tokens, {a.threads} threads, median of {a.rounds})", f"{pre_ours:.1f}",
                     f"{pre_lc:.1f}", f"{pre_ours / pre_lc:.2f}x"))
        rows.append((f"decode tok/s (after {len(chunks[0])}, {a.threads} threads)", f"{dec_ours:.1f}",
                     f"{dec_lc:.1f}", f"{dec_ours / dec_lc:.2f}x"))
    else:
        pre_ours, dec_ours = speed_ours()
        res.update(prefill_tok_s_kvpq=pre_ours, decode_tok_s_kvpq=dec_ours)
        rows.append((f"perplexity ctx {a.ctx}, {len(chunks)} chunks", f"{ppl:.4f} +/- {se:.4f}", "n/a", ""))
        rows.append((f"prefill tok/s ({len(chunks[0])} tokens)", f"{pre_ours:.1f}", "n/a", ""))
        rows.append((f"decode tok/s", f"{dec_ours:.1f}", "n/a", ""))

    print(f"model {os.path.basename(a.model)}, text {os.path.basename(a.text)}, {a.threads} threads, "
          f"kvpq fp32 cache; peer: llama.cpp {'(llama-cpp-python)' if have_llama else 'NOT AVAILABLE: ' + res['llama_cpp']}")
    print(f"{'quantity':52s} {'kvpq':>22s} {'llama.cpp':>22s} {'ratio/diff':>12s}")
    for q, o, p, r in rows:
        print(f"{q:52s} {o:>22s} {p:>22s} {r:>12s}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
