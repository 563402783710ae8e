#!/usr/bin/env python3
"""Per layer, how far a model's keys sit from zero compared with how much they vary, and what that does
to a per-block scalar quantizer (llama.cpp's q4_0) with and without the per-channel mean removed.

Keys are post-RoPE, read from a float32 cache after the model ran the first --tokens tokens of --text.
Per layer, over positions t, KV heads h and channels c:
  mu[h,c]  = mean_t k[t,h,c]               (the key mean kvpq's codebooks subtract, docs/vq_quality.md)
  sd[h,c]  = std_t  k[t,h,c]               (the part that changes the softmax: q . mu is the same for
                                           every position of one query, so it cancels in attention)
  max|mu|  = max over (h, c) of |mu|; rms sd = sqrt(mean over (h, c) of sd^2)
  q4_0 rel err = rms(k - q4_0(k)) / rms sd           (blocks of 32 along head_dim, scale = the signed
                                                   absmax / -8, 4-bit codes: ggml's quantize_row_q4_0)
  centered    = the same with q4_0 applied to k - mu (mu kept exact)
A relative error near or above 1 means q4_0 codes mostly the mean and loses the signal.

    KVPQ_LIB=build/libkvpq_model.so PYTHONPATH=python python3 scripts/key_bias.py \\
        --model models/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf --tokens 1024 --json out.json

Prints a markdown table; --json writes the rows."""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import kvpq  # noqa: E402


def q4_0(x):
    """ggml q4_0 round trip over the last axis in blocks of 32: d = (signed absmax) / -8,
    q = clamp(trunc(x / d + 8.5), 0, 15), x_hat = (q - 8) d."""
    s = x.reshape(*x.shape[:-1], -1, 32).astype(np.float32)
    idx = np.abs(s).argmax(-1)[..., None]
    mx = np.take_along_axis(s, idx, -1)
    d = mx / -8.0
    inv = np.where(d != 0, 1.0 / np.where(d != 0, d, 1), 0)
    q = np.clip(np.trunc(s * inv + 8.5), 0, 15)
    return ((q - 8) * d).reshape(x.shape)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", default="data/text/persuasion.txt")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.tokens < 32:
        sys.exit("key_bias: --tokens must be at least 32")
    m = kvpq.Model(a.model, n_threads=a.threads)
    toks = m.tokenize(Path(a.text).read_text(encoding="utf-8"), m.info["add_bos"])[:a.tokens]
    if m.info["head_dim"] % 32:
        sys.exit(f"key_bias: head_dim {m.info['head_dim']} is not a multiple of 32 (q4_0 blocks)")
    c = m.new_cache("fp32", max_seq=len(toks), sliding_window=0)  # every layer keeps every position
    m.eval(c, toks)
    rows = []
    for layer in range(m.info["n_layer"]):
        k, _ = c.read(layer)
        k = k.astype(np.float64)
        mu, sd = k.mean(0), k.std(0)
        rsd = float(np.sqrt((sd ** 2).mean()))
        err = float(np.sqrt(((k - q4_0(k)) ** 2).mean())) / rsd
        kc = k - mu
        errc = float(np.sqrt(((kc - q4_0(kc)) ** 2).mean())) / rsd
        h, ch = np.unravel_index(np.abs(mu).argmax(), mu.shape)
        rows.append({"layer": layer, "max_abs_mu": float(np.abs(mu).max()), "sd_at_max": float(sd[h, ch]),
                     "rms_sd": rsd, "rms_mu": float(np.sqrt((mu ** 2).mean())),
                     "q4_0_rel_err": err, "q4_0_centered_rel_err": errc})
    print(f"{Path(a.model).name}: {len(toks)} tokens of {a.text}, keys post-RoPE\n")
    print("| layer | max abs mu | sd there | rms mu | rms sd | q4_0 rel. err | centered q4_0 rel. err |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['layer']} | {r['max_abs_mu']:.1f} | {r['sd_at_max']:.2f} | {r['rms_mu']:.2f} | {r['rms_sd']:.2f} | "
              f"{r['q4_0_rel_err']:.3f} | {r['q4_0_centered_rel_err']:.3f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"model": a.model, "text": a.text, "tokens": len(toks), "rows": rows},
                                           indent=1) + "\n")


if __name__ == "__main__":
    main()
