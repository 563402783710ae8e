#!/usr/bin/env python3
"""transformers_gpu.py: SmolLM2-135M generation in transformers on a GPU with KVPQCache (kvpq_cuda_cache)
beside DynamicCache, at long contexts.

transformers loads the model from its GGUF file (from_pretrained(dir, gguf_file=...), dequantized,
then cast to --dtype on the GPU). For each context (--ctx, e.g. 4096,32768) and each cache, in this
process one after the other: the prompt (the first ctx token ids of --ids, kvpq's tokenizer) is
prefilled in one forward call, then --gen tokens are decoded greedily one call each. Reported:
prefill and decode tokens/s (CUDA-synchronized wall time), the cache's own bytes (DynamicCache: its
tensors; KVPQCache: kvpq_cuda_cache_resident_bytes of every layer), the GPU memory the cache holds
after prefill as the device sees it (cudaMemGetInfo's used bytes minus those before the cache, which
also counts kvpq's cudaMalloc'd pages and workspaces that torch's allocator does not see), torch's
peak allocated bytes during the run, and how many greedy tokens equal DynamicCache's.

usage: python3 bench/transformers_gpu.py --ids IDS.npy --codebook CB [--ctx 4096,32768] [--gen 64]
           [--dtype bfloat16] [--model-dir models] [--out DIR]
       python3 bench/transformers_gpu.py --random-smollm2 [--ctx ...]
--random-smollm2: no model file: a Llama with SmolLM2-135M's shape (30 layers, 9 query heads, 3 KV
heads of 64) and random weights, random token ids, and a d4b8 codebook calibrated on its own keys and
values (2048 tokens). Speed and memory only (what the cache costs at a model's shape; the tokens mean
nothing): for a GPU machine that cannot take the model file.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.join(ROOT, "python") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "python"))


def used_bytes(torch):
    free, total = torch.cuda.mem_get_info()
    return total - free


def run(model, ids, make_cache, gen, torch):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base_used = used_bytes(torch)
    base_alloc = torch.cuda.memory_allocated()
    cache = make_cache()
    x = torch.tensor(ids[None], device="cuda")
    with torch.no_grad():
        t0 = time.perf_counter()
        logits = model(x, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        tok = logits[:, -1].argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        t_pre = time.perf_counter() - t0
        torch.cuda.empty_cache()  # activations of the prefill gone: what is left is model + cache
        after_prefill_used = used_bytes(torch) - base_used
        out = [int(tok)]
        t0 = time.perf_counter()
        for _ in range(gen - 1):
            logits = model(tok, past_key_values=cache, use_cache=True).logits
            tok = logits[:, -1].argmax(-1, keepdim=True)
            out.append(int(tok))  # a host sync per token, as generate() has
        torch.cuda.synchronize()
        t_dec = time.perf_counter() - t0
    from kvpq.transformers import KVPQCache
    if isinstance(cache, KVPQCache):
        cb = cache.resident_bytes
    else:
        cb = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    res = {"prefill_tok_s": len(ids) / t_pre, "decode_tok_s": (gen - 1) / t_dec, "cache_bytes": cb,
           "cache_device_bytes_after_prefill": after_prefill_used,
           "peak_allocated_above_model": torch.cuda.max_memory_allocated() - base_alloc, "tokens": out}
    del cache, logits
    torch.cuda.empty_cache()
    return res


def random_smollm2(torch, kvpq):
    """(model, token ids, codebook): SmolLM2-135M's shape with random weights (float32, CPU), random
    ids, a d4b8 codebook from the model's own keys and values of 2048 tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from kvpq.transformers import collect_kv
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                      rope_theta=100000.0, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    ids = np.random.default_rng(0).integers(1, cfg.vocab_size, 65536)
    cb = kvpq.calibrate(collect_kv(model, torch.tensor(ids[:2048]), 2048), keys="d4b8", niter=4)
    cb.set_meta("key_layout", "hf")
    return model, ids, cb


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ids", help=".npy of token ids (kvpq's tokenizer, BOS first)")
    ap.add_argument("--codebook")
    ap.add_argument("--random-smollm2", action="store_true", help="SmolLM2-135M's shape, random weights (above)")
    ap.add_argument("--model-dir", default=os.path.join(ROOT, "models"))
    ap.add_argument("--model-file", default="SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--ctx", default="4096,32768")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default="out/transformers_gpu")
    a = ap.parse_args()

    import torch
    import kvpq
    from kvpq.transformers import KVPQCache
    from transformers import AutoModelForCausalLM, DynamicCache
    import transformers
    ok, why = kvpq.cuda_available()
    if not torch.cuda.is_available() or not ok:
        print(f"SKIP: no CUDA device or libkvpq without CUDA ({why})")
        return 77
    dtype = getattr(torch, a.dtype)
    t0 = time.perf_counter()
    if a.random_smollm2:
        model, all_ids, cb = random_smollm2(torch, kvpq)
        a.model_file = "random weights, SmolLM2-135M's shape"
        a.codebook = "d4b8 calibrated on the model's own keys and values"
    elif not (a.ids and a.codebook):
        ap.error("--ids and --codebook are needed (or --random-smollm2)")
    else:
        model = AutoModelForCausalLM.from_pretrained(a.model_dir, gguf_file=a.model_file, dtype=torch.float32)
        all_ids = np.load(a.ids).astype(np.int64)
        cb = kvpq.Codebook.load(a.codebook)
    model = model.to("cuda", dtype).eval()
    t_load = time.perf_counter() - t0
    model.set_attn_implementation("sdpa")
    rows = []
    for ctx in [int(c) for c in a.ctx.split(",")]:
        ids = np.resize(all_ids, ctx)  # the text repeated if it is shorter than ctx
        max_seq = ctx + a.gen
        model.config.max_position_embeddings = max(model.config.max_position_embeddings, max_seq)
        model.set_attn_implementation("sdpa")
        dyn = run(model, ids, lambda: DynamicCache(config=model.config), a.gen, torch)
        kv = run(model, ids, lambda: KVPQCache(cb, model, max_seq=max_seq), a.gen, torch)
        same = 0
        for x, y in zip(dyn["tokens"], kv["tokens"]):
            if x != y:
                break
            same += 1
        r = {"ctx": ctx, "gen": a.gen, "dynamic": dyn, "kvpq": kv, "greedy_prefix_equal": same}
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items()}, default=str)[:600], flush=True)
    dev = torch.cuda.get_device_properties(0)
    lines = [f"Device {dev.name}; torch {torch.__version__}, transformers {transformers.__version__}; model "
             f"{a.model_file} (from GGUF, {a.dtype} on the GPU; load {t_load:.1f} s); codebook "
             f"{os.path.basename(a.codebook)}; prefill in one call, then {a.gen} greedy tokens.", "",
             "| context | cache | cache MiB | vs Dynamic | device MiB held after prefill | prefill tok/s | decode tok/s "
             "| vs Dynamic | peak alloc MiB | greedy tokens equal |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d, k = r["dynamic"], r["kvpq"]
        for name, x in (("DynamicCache", d), ("KVPQCache", k)):
            lines.append(f"| {r['ctx']} | {name} | {x['cache_bytes'] / 2**20:.1f} | {x['cache_bytes'] / d['cache_bytes']:.3f} "
                         f"| {x['cache_device_bytes_after_prefill'] / 2**20:.1f} | {x['prefill_tok_s']:.0f} "
                         f"| {x['decode_tok_s']:.1f} | {x['decode_tok_s'] / d['decode_tok_s']:.2f} "
                         f"| {x['peak_allocated_above_model'] / 2**20:.0f} "
                         f"| {'-' if x is d else str(r['greedy_prefix_equal']) + ' of ' + str(r['gen'])} |")
    md = "\n".join(lines) + "\n"
    print(md)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "transformers_gpu.md"), "w") as f:
        f.write(md)
    with open(os.path.join(a.out, "transformers_gpu.json"), "w") as f:
        json.dump({"device": dev.name, "torch": torch.__version__, "transformers": transformers.__version__,
                   "dtype": a.dtype, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
