"""kvpq's dequantization of real model tensors vs the PyPI gguf package (GGUFReader +
gguf.quants.dequantize): must be bit-exact (np.array_equal on float32). kvpq is called through
the kvpq package: kvpq.gguf_dequantize (kvpq_gguf_dequantize_tensor)."""
import os
import subprocess

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

SRC = os.environ.get("KVPQ_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
MODEL = os.path.join(SRC, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
BIN = os.environ.get("KVPQ_BIN")

pytestmark = [
    pytest.mark.skipif(not os.path.exists(MODEL), reason=f"model missing: {MODEL} (scripts/fetch_model.sh)"),
]

# A Q4_1 of each shape the forward pass uses, the Q8_0 embedding (tied output), F32 norms.
TENSORS = [
    "blk.0.attn_q.weight",
    "blk.0.attn_k.weight",
    "blk.7.ffn_down.weight",
    "blk.29.ffn_gate.weight",
    "token_embd.weight",
    "blk.3.attn_norm.weight",
    "output_norm.weight",
]


@pytest.fixture(scope="module")
def lib():
    import kvpq
    return kvpq


@pytest.fixture(scope="module")
def reader():
    return gguf.GGUFReader(MODEL)


def kvpq_dequant(lib, name):
    return lib.gguf_dequantize(MODEL, name)


LEVELS = {0: "scalar", 1: "avx2", 2: "avx512"}


@pytest.mark.parametrize("name", TENSORS)
def test_bit_exact_with_gguf_package(lib, reader, name):
    """At every SIMD level this CPU has (kvpq_simd_set), as the SIMD dequantizers must be bit-exact too."""
    t = next(t for t in reader.tensors if t.name == name)
    want = quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(-1)
    # The values are not trivial (a zero-filled result would also be 'equal' to zeros).
    assert np.count_nonzero(want) > want.size // 2
    best = lib.simd_get()
    try:
        for level in [LEVELS[i] for i in range(list(LEVELS.values()).index(best) + 1)]:
            lib.simd_set(level)
            got = kvpq_dequant(lib, name)
            assert got.shape == want.shape
            # Compare bit patterns so that -0.0 vs 0.0 or NaN payloads would also be caught.
            mism = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
            assert mism.size == 0, f"{name} ({t.tensor_type.name}, simd {LEVELS[level]}): {mism.size} of " \
                                   f"{got.size} differ, first at {mism[:5]}: kvpq {got[mism[:5]]} gguf {want[mism[:5]]}"
    finally:
        lib.simd_set(best)


def test_errors_are_named(lib):
    with pytest.raises(lib.Error) as e:
        lib.gguf_dequantize(MODEL, "no.such.tensor")
    assert e.value.status == -1 and "no.such.tensor" in e.value.detail
    out = lib.ffi.new("float[]", 4)  # the raw C call, for a buffer too small
    assert lib.lib.kvpq_gguf_dequantize_tensor(MODEL.encode(), b"output_norm.weight", out, 4, lib.ffi.NULL) == -1
    assert "576 elements" in lib.last_error()
    with pytest.raises(lib.Error) as e:
        lib.gguf_dequantize("/nonexistent.gguf", "x")
    assert e.value.status == -3


@pytest.mark.skipif(not BIN, reason="KVPQ_BIN not set")
def test_info_cli_lists_model(reader):
    r = subprocess.run([BIN, "info", MODEL], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "llama.block_count" in r.stdout and "= 30" in r.stdout
    assert "token_embd.weight" in r.stdout and "Q8_0" in r.stdout and "[576, 49152]" in r.stdout
    assert f"vocab {len(reader.fields['tokenizer.ggml.tokens'].data)}" in r.stdout
    # Every tensor appears once with its gguf-package type and shape (ne order).
    for t in reader.tensors:
        shape = "[" + ", ".join(str(int(x)) for x in t.shape) + "]"
        line = next(l for l in r.stdout.splitlines() if f" {t.name} " in l)
        assert t.tensor_type.name in line and shape in line, line
