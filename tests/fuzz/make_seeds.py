"""Write the seed corpus for fuzz_gguf (small valid GGUF files made by the PyPI gguf package's
GGUFWriter, a peer writer, plus the start of the real model when present). Total well under 100 KiB.
Usage: python3 tests/fuzz/make_seeds.py tests/fuzz/corpus_gguf"""
import os
import sys

import numpy as np
import gguf

out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "corpus_gguf")
os.makedirs(out, exist_ok=True)
rng = np.random.default_rng(0)


def q_bytes(qtype, rows, n):
    """Random quantized rows of a ggml type: (rows, n/blck*size) uint8 with sane fp16 scales."""
    blck, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, n // blck, size), dtype=np.uint8)
    scale = np.array([0.01], dtype=np.float16).view(np.uint8)
    raw[:, :, 0:2] = scale
    return raw.reshape(rows, -1)


def write(name, alignment=None, tensors=True, arch="llama"):
    w = gguf.GGUFWriter(os.path.join(out, name), arch)
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_block_count(2)
    w.add_context_length(64)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_uint8("test.u8", 7)
    w.add_int8("test.i8", -7)
    w.add_uint16("test.u16", 700)
    w.add_int16("test.i16", -700)
    w.add_int32("test.i32", -70000)
    w.add_uint64("test.u64", 1 << 40)
    w.add_int64("test.i64", -(1 << 40))
    w.add_float64("test.f64", 0.5)
    w.add_bool("test.bool", True)
    w.add_array("test.arr_i32", [1, -2, 3])
    w.add_array("test.arr_f32", [0.5, 1.5])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(["<|endoftext|>", "a", "b", "ab", "\u0120the"])
    w.add_token_merges(["a b"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    if tensors:
        w.add_tensor("token_embd.weight", q_bytes(gguf.GGMLQuantizationType.Q8_0, 5, 64),
                     raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor("blk.0.attn_q.weight", q_bytes(gguf.GGMLQuantizationType.Q4_1, 4, 64),
                     raw_dtype=gguf.GGMLQuantizationType.Q4_1)
        w.add_tensor("blk.0.attn_k.weight", q_bytes(gguf.GGMLQuantizationType.Q4_0, 2, 64),
                     raw_dtype=gguf.GGMLQuantizationType.Q4_0)
        w.add_tensor("blk.0.attn_v.weight", q_bytes(gguf.GGMLQuantizationType.Q5_1, 2, 64),
                     raw_dtype=gguf.GGMLQuantizationType.Q5_1)
        w.add_tensor("blk.0.ffn_up.weight", rng.standard_normal((3, 64)).astype(np.float16))
        w.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(64).astype(np.float32))
        w.add_tensor("blk.0.cube", rng.standard_normal((2, 3, 4, 8)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_kquants(name):
    """One small tensor of each K-quant type (2 rows of 256) and a Q5_0 one (Gemma's), so that the
    fuzzer starts from files whose tensors reach the K-quant dequantization and matvec kernels."""
    w = gguf.GGUFWriter(os.path.join(out, name), "qwen2")
    w.add_block_count(1)
    T = gguf.GGMLQuantizationType
    for qt in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.Q5_0):
        raw = q_bytes(qt, 2, 256)
        # the fp16 scales of the K-quant layouts are not at offset 0: set them sane as well
        blck, size = gguf.GGML_QUANT_SIZES[qt]
        offs = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}.get(qt, ())
        blocks = raw.reshape(2, -1, size)
        for o in offs:
            blocks[:, :, o:o + 2] = np.array([0.01], dtype=np.float16).view(np.uint8)
        w.add_tensor(f"blk.0.{qt.name.lower()}.weight", blocks.reshape(2, -1), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


write("small_v3.gguf")
write("small_align64.gguf", alignment=64)
write("no_tensors.gguf", tensors=False)
write_kquants("kquants.gguf")
model = os.path.join(os.path.dirname(__file__), "..", "..", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
if os.path.exists(model):
    with open(model, "rb") as f, open(os.path.join(out, "model_prefix.gguf"), "wb") as g:
        g.write(f.read(8192))
print(sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out)), "bytes in", out)
