"""Write the seed corpus for fuzz_model: tiny but complete GGUF models of each architecture of
src/model/arch.c (llama, qwen2 with Q/K/V biases and its pre-tokenizer, gemma3 with q/k norms,
post norms, sliding-window layers, logit softcapping and a SentencePiece vocabulary; every tensor
the loader needs, a byte-level BPE vocabulary with ChatML control tokens, a chat template), made by
the PyPI gguf package, each under the 4096 bytes scripts/fuzz.sh lets an input grow to.
Usage: python3 tests/fuzz/make_model_seeds.py [tests/fuzz/corpus/model]"""
import os
import sys

import gguf
import numpy as np

out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "corpus", "model")
os.makedirs(out, exist_ok=True)
rng = np.random.default_rng(14)


def write(name, E=8, H=2, HKV=1, F=8, L=1, tied=True, f16=False, special=True, arch="llama"):
    w = gguf.GGUFWriter(os.path.join(out, name), arch)
    w.add_name("tiny")
    w.add_block_count(L)
    w.add_context_length(32)
    w.add_embedding_length(E)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(HKV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    if arch == "gemma3":  # SentencePiece: scores, <0xNN> byte fallback, U+2581 word marker
        w.add_tokenizer_model("llama")
        toks = ["<pad>", "<bos>", "<eos>", "<0x61>", "<0x62>", "<0x20>", "a", "b", "ab", "\u2581", "\u2581a"]
        w.add_token_list(toks)
        w.add_token_scores([0.0, 0.0, 0.0, -9.0, -9.0, -9.0, -1.0, -1.0, -0.5, -2.0, -0.7])
        w.add_token_types([3, 3, 3, 6, 6, 6, 1, 1, 1, 1, 1])  # 6 = BYTE
        w.add_add_space_prefix(True)
        w.add_sliding_window(2)
        w.add_key_value("gemma3.attention.sliding_window_pattern", 2, gguf.GGUFValueType.UINT32)
        w.add_key_value("gemma3.final_logit_softcapping", 30.0, gguf.GGUFValueType.FLOAT32)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "smollm")
        toks = ["<|im_start|>", "<|im_end|>", "a", "b", "ab", "\u0120", "\u0120a"]
        w.add_token_list(toks)
        if special:
            w.add_token_types([3, 3, 1, 1, 1, 1, 1])  # llama.cpp: 3 = CONTROL, 1 = NORMAL
        w.add_token_merges(["a b", "\u0120 a"])
    w.add_bos_token_id(1 if arch == "gemma3" else 0)
    w.add_eos_token_id(2 if arch == "gemma3" else 1)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}")
    V, D = len(toks), E // H
    dt = np.float16 if f16 else np.float32

    def t(name, *shape):
        w.add_tensor(name, (0.5 * rng.standard_normal(shape)).astype(dt))
    t("token_embd.weight", V, E)
    if not tied:
        t("output.weight", V, E)
    w.add_tensor("output_norm.weight", np.ones(E, np.float32))
    for l in range(L):
        t(f"blk.{l}.attn_q.weight", H * D, E)
        t(f"blk.{l}.attn_k.weight", HKV * D, E)
        t(f"blk.{l}.attn_v.weight", HKV * D, E)
        t(f"blk.{l}.attn_output.weight", E, H * D)
        t(f"blk.{l}.ffn_gate.weight", F, E)
        t(f"blk.{l}.ffn_up.weight", F, E)
        t(f"blk.{l}.ffn_down.weight", E, F)
        w.add_tensor(f"blk.{l}.attn_norm.weight", np.ones(E, np.float32))
        w.add_tensor(f"blk.{l}.ffn_norm.weight", np.ones(E, np.float32))
        if arch == "qwen2":
            for n_, rows in (("q", H * D), ("k", HKV * D), ("v", HKV * D)):
                w.add_tensor(f"blk.{l}.attn_{n_}.bias", (0.1 * rng.standard_normal(rows)).astype(np.float32))
        if arch == "gemma3":
            for n_, size in (("attn_q_norm", D), ("attn_k_norm", D), ("post_attention_norm", E), ("post_ffw_norm", E)):
                w.add_tensor(f"blk.{l}.{n_}.weight", np.ones(size, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    size = os.path.getsize(os.path.join(out, name))
    assert size <= 4096, (name, size)


write("tiny_llama.gguf")
write("tiny_llama_untied_f16.gguf", tied=False, f16=True, special=False)
write("tiny_llama_gqa_2layers.gguf", E=8, H=4, HKV=2, F=4, L=2, f16=True)
write("tiny_qwen2.gguf", arch="qwen2")
write("tiny_gemma3.gguf", E=8, H=2, HKV=1, F=4, L=1, arch="gemma3")
print(sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out)), "bytes in", out)
