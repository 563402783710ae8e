#!/usr/bin/env python3
"""quant.cpp (PyPI `quantcpp`, public repository zetta-app/quant.cpp) as an external KV-cache peer,
scored on kvpq's token ids exactly as `kvpq ppl --kl-base` scores kvpq's caches.

quant.cpp's own `quant --ppl` tokenizes wrongly and its PyPI wheel has no perplexity tool, so this
script drives its C library through ctypes (no quant.cpp code is copied): the text is tokenized by
kvpq (`kvpq.Model(path).tokenize`), cut into chunks of C tokens (first token replaced by BOS when the
model adds BOS), and each chunk is fed token by token through `tq_forward` once per cache, all caches
in lockstep (one state each). The logits at positions C/2 .. C-2 are scored against tokens
C/2+1 .. C-1: perplexity, and against quant.cpp's own full-precision cache (kv_type = TQ_TYPE_COUNT:
fp32 keys and values) the mean KL(base || cache) in nats and the top-1 agreement.

Bits per element are what the state stores and attention reads (tq_create_state_ex / self-attention
of quant.cpp): keys of a quantized kv_type are ceil(head_dim / block) blocks of type_size bytes per
head and position (a 64-wide head fills half of a 128-element block), values are fp16 unless
value_quant_bits is 4 (16 packed bytes + an fp32 scale per 32 values = 5 bits) or 2 (3 bits); the
baseline keeps fp32 keys and values. (quant.cpp also allocates an unused fp32 key buffer beside the
codes; it is not counted.)

Output: JSON with schema kvpq.ppl/1 (docs/json.md), one row per cache, so
scripts/main_job_models.py can put the rows beside kvpq's; rows carry key_bits / value_bits and the
library path. Cache specs: `fp32` (the base), a quant.cpp type name (`turbo_kv_3b`, `uniform_4b`,
...), optionally `+v4` / `+v2` for quantized values.

Caution: the PyPI wheel (quantcpp 0.13.0) is built from the single header quant.h, in which the
turbo_kv_* types are stubs (quantize writes nothing, dequantize returns zeros); this script refuses a
stubbed type (two types sharing one quantize function). For turbo_kv_* build the library from the
repository's sources (`--lib`, see docs/main_job.md "quant.cpp beside kvpq").
"""
import argparse
import ctypes
import datetime
import json
import math
import os
import sys
import time

import numpy as np


class Traits(ctypes.Structure):
    """tq_type_traits_t (include/turboquant/tq_types.h): name, block_size, type_size, bpe, 3 fns, residual."""
    _fields_ = [("name", ctypes.c_char_p), ("block_size", ctypes.c_size_t), ("type_size", ctypes.c_size_t),
                ("bpe", ctypes.c_float), ("quantize", ctypes.c_void_p), ("dequantize", ctypes.c_void_p),
                ("attention", ctypes.c_void_p), ("residual_type", ctypes.c_int)]


def default_lib():
    """libquant.so of the installed PyPI quantcpp package."""
    import quantcpp
    return os.path.join(os.path.dirname(quantcpp.__file__), "libquant.so")


class QuantLib:
    """ctypes view of a quant.cpp shared library (libquant.so of the wheel or libturboquant.so)."""

    def __init__(self, path):
        self.path = os.path.abspath(path)
        L = self.lib = ctypes.CDLL(self.path)
        L.tq_load_model.restype, L.tq_load_model.argtypes = ctypes.c_void_p, [ctypes.c_char_p]
        L.tq_create_state_ex.restype = ctypes.c_void_p
        L.tq_create_state_ex.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        L.tq_forward.restype = ctypes.POINTER(ctypes.c_float)
        L.tq_forward.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        L.tq_free_state.argtypes = [ctypes.c_void_p]
        L.tq_free_model.argtypes = [ctypes.c_void_p]
        L.tq_type_name.restype = ctypes.c_char_p
        self.n_types = L.tq_type_count()
        self.traits = (Traits * self.n_types).in_dll(L, "TQ_TRAITS")
        if hasattr(L, "tq_set_threads"):
            L.tq_set_threads.argtypes = [ctypes.c_int]

    def type_id(self, name):
        """The kv_type of a type name; SystemExit for an unknown or stubbed type."""
        names = [self.traits[i].name.decode() for i in range(self.n_types)]
        if name not in names:
            raise SystemExit(f"quantcpp_peer: {self.path} has no KV type {name!r} (it has {', '.join(names)})")
        i = names.index(name)
        q = self.traits[i].quantize
        if q is None or any(self.traits[j].quantize == q for j in range(self.n_types) if j != i):
            raise SystemExit(f"quantcpp_peer: {self.path}: {name} is a stub in this build (its quantize function is "
                             "shared with other types: writes nothing, reads zeros); build quant.cpp from its sources")
        return i

    def key_bits(self, kv_type, head_dim):
        """Bits per key element the quantized cache stores: whole blocks per head (tq_create_state_ex)."""
        t = self.traits[kv_type]
        return math.ceil(head_dim / t.block_size) * t.type_size * 8 / head_dim


def parse_spec(spec):
    """'turbo_kv_3b+v4' -> ('turbo_kv_3b', 4); 'fp32' -> ('fp32', 0)."""
    name, _, v = spec.partition("+")
    if v not in ("", "v4", "v2"):
        raise SystemExit(f"quantcpp_peer: cache {spec!r}: value suffix must be +v4 or +v2")
    vbits = int(v[1:]) if v else 0
    if name == "fp32" and vbits:
        raise SystemExit("quantcpp_peer: the fp32 base has no value quantization")
    return name, vbits


class Run:
    """One cache: its state, bits and running sums over scored positions."""

    def __init__(self, ql, model, cfg, spec):
        self.spec = spec
        name, vbits = parse_spec(spec)
        kv = ql.n_types if name == "fp32" else ql.type_id(name)
        self.ql, self.model, self.cfg, self.kv, self.vbits = ql, model, cfg, kv, vbits
        head_dim = cfg[5]
        self.key_bits = 32.0 if name == "fp32" else ql.key_bits(kv, head_dim)
        self.value_bits = {0: 32.0 if name == "fp32" else 16.0, 4: 5.0, 2: 3.0}[vbits]
        self.state, self.seconds = None, 0.0
        self.nll, self.nll2, self.kl, self.agree = 0.0, 0.0, 0.0, 0

    def reset(self):
        """A fresh (empty) cache for a new chunk."""
        if self.state:
            self.ql.lib.tq_free_state(self.state)
        self.state = self.ql.lib.tq_create_state_ex(self.model, self.kv, self.vbits)
        if not self.state:
            raise SystemExit(f"quantcpp_peer: tq_create_state_ex failed for {self.spec}")

    def step(self, tok, pos, vocab):
        """Logits (float64 log-softmax, shape (vocab,)) after feeding tok at pos."""
        t0 = time.perf_counter()
        p = self.ql.lib.tq_forward(self.model, self.state, int(tok), pos)
        self.seconds += time.perf_counter() - t0
        if not p:
            raise SystemExit(f"quantcpp_peer: tq_forward returned NULL ({self.spec}, pos {pos})")
        x = np.ctypeslib.as_array(p, shape=(vocab,)).astype(np.float64)
        m = x.max()
        return x - (m + math.log(np.exp(x - m).sum()))


def score(run, lp, nxt, base_lp):
    """Add one scored position: NLL of nxt, KL(base || run) and top-1 agreement with the base."""
    v = -lp[nxt]
    run.nll += v
    run.nll2 += v * v
    if base_lp is not None:
        run.kl += max(0.0, float(np.dot(np.exp(base_lp), base_lp - lp)))
        run.agree += int(np.argmax(lp) == np.argmax(base_lp))


def eval_chunk(runs, model_cfg, toks):
    """Feed one chunk through every cache in lockstep; score positions C/2 .. C-2."""
    C, vocab = len(toks), model_cfg[6]
    for r in runs:
        r.reset()
    for pos in range(C - 1):
        lps = [r.step(toks[pos], pos, vocab) for r in runs]
        if pos >= C // 2:
            for r, lp in zip(runs, lps):
                score(r, lp, toks[pos + 1], lps[0])


def row(r, base, count, chunks, C, lib, label):
    """A kvpq.ppl/1 row (docs/json.md) plus key_bits / value_bits / library; the base's own row has KL 0,
    top-1 1 (as kvpq ppl's row of its --kl-base cache)."""
    ppl = math.exp(r.nll / count)
    var = max(0.0, r.nll2 / count - (r.nll / count) ** 2)
    o = {"cache": f"{label}:{r.spec}", "ppl": ppl, "ppl_stderr": math.sqrt(var / (count - 1)) * ppl,
         "tokens": count, "chunks": chunks, "ctx": C,
         "bits_per_element": (r.key_bits + r.value_bits) / 2, "key_bits": r.key_bits, "value_bits": r.value_bits,
         "tok_per_s": chunks * (C - 1) / r.seconds, "library": lib}
    o.update({"kl_base": f"{label}:{base.spec}", "ppl_base": math.exp(base.nll / count),
              "kl_mean": r.kl / count, "top1_agree": r.agree / count,
              "bits_per_element_base": (base.key_bits + base.value_bits) / 2})
    return o


def kvpq_tokens(model_path, text_path):
    """kvpq's token ids of the text (BOS prepended when the model adds BOS), BOS id and add_bos."""
    import kvpq
    m = kvpq.Model(model_path)
    add_bos, bos = bool(m.info["add_bos"]), int(m.info["bos_id"])
    text = open(text_path, encoding="utf-8").read()
    return m.tokenize(text, add_bos=add_bos), bos, add_bos


def load_model(ql, path, ctx):
    """tq_load_model with TQ_NO_Q4=1 (GGUF weights kept as they are); its config's first 8 ints."""
    os.environ["TQ_NO_Q4"] = "1"
    model = ql.lib.tq_load_model(path.encode())
    if not model:
        raise SystemExit(f"quantcpp_peer: tq_load_model failed on {path}")
    cfg = ctypes.cast(model, ctypes.POINTER(ctypes.c_int * 8)).contents
    if cfg[7] < ctx:  # max_seq_len capped at load; the state is sized from it
        cfg[7] = ctx
    return model, cfg


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--chunks", type=int, default=1)
    ap.add_argument("--cache", default="uniform_4b",
                    help="comma-separated quant.cpp KV type names (uniform_4b, its default; turbo_kv_3b ... with a "
                         "source build), each optionally +v4 / +v2; fp32, the base, is always run first")
    ap.add_argument("--lib", default=None, help="quant.cpp shared library (default: the PyPI wheel's libquant.so)")
    ap.add_argument("--label", default="qcpp", help="row name prefix, e.g. qcpp-wheel / qcpp-src (default qcpp)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="write the kvpq.ppl/1 JSON here (else stdout)")
    a = ap.parse_args()
    if a.ctx < 4 or a.chunks < 1:
        raise SystemExit("quantcpp_peer: --ctx must be >= 4 and --chunks >= 1")
    ql = QuantLib(a.lib or default_lib())
    if hasattr(ql.lib, "tq_set_threads"):
        ql.lib.tq_set_threads(a.threads)
    toks, bos, add_bos = kvpq_tokens(a.model, a.text)
    n_chunks = min(a.chunks, len(toks) // a.ctx)
    if n_chunks < 1:
        raise SystemExit(f"quantcpp_peer: {a.text} has {len(toks)} tokens, fewer than one chunk of {a.ctx}")
    model, cfg = load_model(ql, a.model, a.ctx)
    specs = ["fp32"] + [s for s in a.cache.split(",") if s and s != "fp32"]
    runs = [Run(ql, model, cfg, s) for s in specs]
    for ch in range(n_chunks):
        ct = list(toks[ch * a.ctx:(ch + 1) * a.ctx])
        if add_bos:
            ct[0] = bos
        eval_chunk(runs, cfg, ct)
        write(a, ql, runs, ch + 1)  # after every chunk: a cut-short run keeps what it scored


def write(a, ql, runs, n_chunks):
    """The kvpq.ppl/1 JSON of the first n_chunks chunks (to --json, else stdout) and a progress line."""
    count = n_chunks * (a.ctx - 1 - a.ctx // 2)
    print(f"quantcpp_peer: {n_chunks} chunk(s): " + ", ".join(
        f"{r.spec} {math.exp(r.nll / count):.4f}" for r in runs), file=sys.stderr, flush=True)
    out = {"schema": "kvpq.ppl/1",
           "settings": {"model": a.model, "text": a.text, "ctx": a.ctx, "chunks": n_chunks, "threads": a.threads,
                        "kl_base": f"{a.label}:fp32", "peer": "quant.cpp", "library": ql.path,
                        "command": " ".join(sys.argv), "date": datetime.datetime.utcnow().isoformat() + "Z"},
           "results": [row(r, runs[0], count, n_chunks, a.ctx, ql.path, a.label) for r in runs]}
    text = json.dumps(out, indent=1)
    if a.json:
        open(a.json, "w").write(text + "\n")
    else:
        print(text)

if __name__ == "__main__":
    main()
