#!/usr/bin/env python3
"""greedy_emulate_llama.py — is a greedy divergence from llama.cpp a near-tie of arithmetic? A numpy Llama
forward pass (bench/llama_cpp_peer.py's NumpyLlama: weights from the PyPI gguf package's dequantize)
run two ways on the same token ids, greedy from the prompt of bench/models_peer.py:
  * float32 activations, float32 K/V (kvpq's arithmetic: its logits agree with this to ~5e-5);
  * llama.cpp's arithmetic: every activation row quantized to 8 bits in blocks of 32 before each matrix
    product (ggml's quantize_row_q8_0 / q8_1: d = max|x| / 127 stored as fp16, q = round(x / d): the
    vec_dot_type of Q4_1 / Q8_0 weights), K, V, the query and the softmax probabilities rounded to fp16
    (the f16 KV cache and ggml's f16 mul_mat inputs).
Per step: the top-2 tokens and logits of each, and the logits of two tokens to watch (--watch).
llama-arch files only (SmolLM2).

usage: python3 bench/greedy_emulate_llama.py [--model models/SmolLM2-135M-Instruct.Q4_1.gguf]
           [--prompt-ids 504,3575,282,4649,314] [-n 8] [--watch 2988,1797]
"""
import argparse
import math
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import llama_cpp_peer as P  # noqa: E402
def q8(x):
    """llama.cpp's quantize_row_q8_0/q8_1 of activation rows (blocks of 32): d = amax/127, q = round(x/d)."""
    s = x.shape
    b = x.reshape(-1, 32).astype(np.float32)
    amax = np.abs(b).max(-1, keepdims=True)
    d = amax / 127.0
    idd = np.where(d > 0, 1.0 / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.round(b * idd)  # roundf: half away from zero; np.round is half-even (ties are measure-zero here)
    d16 = d.astype(np.float16).astype(np.float32)  # the block scale is stored as fp16
    return (q * d16).reshape(s).astype(np.float32)

class Emu(P.NumpyLlama):
    def forward(self, tokens, emulate):
        n = len(tokens); w = self.w
        hd, H, Hk = self.head_dim, self.n_head, self.n_head_kv
        mm = (lambda h, W: q8(h) @ W.T) if emulate else (lambda h, W: h @ W.T)
        f16 = (lambda a: a.astype(np.float16).astype(np.float32)) if emulate else (lambda a: a)
        x = w["token_embd.weight"][np.asarray(tokens)]
        pos = np.arange(n, dtype=np.float64)
        mask = np.triu(np.full((n, n), -np.inf, dtype=np.float32), 1)
        for l in range(self.n_layer):
            p = f"blk.{l}."
            h = self.rmsnorm(x, w[p + "attn_norm.weight"])
            q = self.rope(mm(h, w[p + "attn_q.weight"]).reshape(n, H, hd), pos)
            k = f16(self.rope(mm(h, w[p + "attn_k.weight"]).reshape(n, Hk, hd), pos))
            v = f16(mm(h, w[p + "attn_v.weight"]).reshape(n, Hk, hd))
            g = H // Hk
            att = np.empty((n, H, hd), dtype=np.float32)
            for hh in range(H):
                s = f16(q[:, hh, :]) @ k[:, hh // g, :].T / math.sqrt(hd) + mask
                s = np.exp(s - s.max(-1, keepdims=True)); s /= s.sum(-1, keepdims=True)
                att[:, hh, :] = f16(s) @ v[:, hh // g, :]
            x = x + mm(att.reshape(n, H * hd), w[p + "attn_output.weight"])
            h = self.rmsnorm(x, w[p + "ffn_norm.weight"])
            gt = mm(h, w[p + "ffn_gate.weight"]); up = mm(h, w[p + "ffn_up.weight"])
            x = x + mm(gt / (1 + np.exp(-gt)) * up, w[p + "ffn_down.weight"])
        return mm(self.rmsnorm(x, w["output_norm.weight"]), w["output.weight"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--prompt-ids", default="504,3575,282,4649,314")  # "The capital of France is"
    ap.add_argument("-n", type=int, default=8)
    ap.add_argument("--watch", default="2988,1797")  # " answer" (kvpq's step 5), " United" (llama.cpp's)
    a = ap.parse_args()
    m = Emu(a.model)
    prompt = [int(t) for t in a.prompt_ids.split(",")]
    watch = [int(t) for t in a.watch.split(",") if t]
    for emulate in (False, True):
        name = "llama.cpp arithmetic" if emulate else "float32"
        toks = list(prompt)
        for step in range(a.n):
            lg = m.forward(toks, emulate)[-1]
            o = np.argsort(lg)[::-1][:2]
            w = " ".join(f"logit[{t}] {lg[t]:.4f}" for t in watch)
            print(f"{name:20s} step {step}: {int(o[0]):6d} {lg[o[0]]:9.4f}  {int(o[1]):6d} {lg[o[1]]:9.4f}  "
                  f"margin {lg[o[0]] - lg[o[1]]:.4f}  {w}", flush=True)
            toks.append(int(o[0]))
        print(f"{name}: generated {toks[len(prompt):]}")


if __name__ == "__main__":
    sys.exit(main())
