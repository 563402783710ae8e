"""K-quant (Q2_K..Q6_K) and the other weight types of Qwen2.5-Coder-1.5B and Gemma-3-270M: kvpq's
dequantization vs the PyPI gguf package's (GGUFReader + gguf.quants.dequantize), bit-exact in float32
(bit patterns compared) at every SIMD level this CPU has. Two sources of blocks:
- real tensors of the two model files (a few small ones per type, so that CI reads megabytes, not the
  whole 1.1 GB file), and a check that every type present in each file is among them;
- random blocks of every K-quant type (Q2_K, Q3_K, Q5_K appear in neither file) and of Q4_0, Q4_1,
  Q5_0, Q5_1, Q8_0 (Q5_0 / Q5_1 have SIMD kernels, ggml_body.h; Q5_1 is in neither file) with random
  finite fp16 scales over the whole fp16 range, written to a GGUF file by gguf's GGUFWriter.
kvpq is called through the kvpq package: kvpq.gguf_dequantize (kvpq_gguf_dequantize_tensor)."""
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import quants  # noqa: E402

SRC = os.environ.get("KVPQ_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
QWEN = os.path.join(SRC, "models", "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf")
GEMMA = os.path.join(SRC, "models", "gemma-3-270m-Q4_K_M.gguf")
LIB = os.environ.get("KVPQ_LIB")

pytestmark = pytest.mark.skipif(not LIB, reason="KVPQ_LIB not set (run through ctest)")

# (file, tensor): for each type of the file, its smallest tensors (and one FFN matrix of each K-quant).
REAL = [
    (QWEN, "blk.0.attn_k.weight"),  # Q4_K (1536 x 256)
    (QWEN, "blk.5.attn_q.weight"),  # Q4_K (1536 x 1536)
    (QWEN, "blk.0.attn_v.weight"),  # Q6_K (1536 x 256)
    (QWEN, "blk.0.ffn_down.weight"),  # Q6_K (8960 x 1536)
    (QWEN, "blk.0.attn_q.bias"),  # F32
    (GEMMA, "blk.0.attn_output.weight"),  # Q4_K (1024 x 640)
    (GEMMA, "blk.0.ffn_down.weight"),  # Q6_K (2048 x 640)
    (GEMMA, "blk.0.attn_k.weight"),  # Q5_0 (640 x 256)
    (GEMMA, "blk.3.ffn_up.weight"),  # Q5_0 (640 x 2048)
    (GEMMA, "blk.0.attn_q.weight"),  # Q5_0 (640 x 1024): the SIMD Q5_0 kernel on a third real matrix
    (GEMMA, "blk.0.attn_v.weight"),  # Q8_0 (640 x 256)
    (GEMMA, "blk.0.attn_q_norm.weight"),  # F32
]

LEVELS = {0: "scalar", 1: "avx2", 2: "avx512"}


@pytest.fixture(scope="module")
def lib():
    import kvpq
    return kvpq


_readers = {}


def reader(path):
    if not os.path.exists(path):
        pytest.skip(f"model missing: {path} (scripts/fetch_model.sh all)")
    if path not in _readers:
        _readers[path] = gguf.GGUFReader(path)
    return _readers[path]


def kvpq_dequant(lib, path, name):
    return lib.gguf_dequantize(path, name)


def assert_bit_exact_every_level(lib, path, name, want, what):
    best = lib.simd_get()
    names = list(LEVELS.values())
    try:
        for level in names[: names.index(best) + 1]:
            lib.simd_set(level)
            got = kvpq_dequant(lib, path, name)
            assert got.shape == want.shape
            # Bit patterns, so that -0.0 vs 0.0 would be caught too.
            mism = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
            assert mism.size == 0, f"{what} (simd {level}): {mism.size} of {got.size} differ, first at " \
                                   f"{mism[:5]}: kvpq {got[mism[:5]]} gguf {want[mism[:5]]}"
    finally:
        lib.simd_set(best)


@pytest.mark.parametrize("path,name", REAL, ids=[f"{os.path.basename(p)[:5]}:{n}" for p, n in REAL])
def test_real_tensor_bit_exact(lib, path, name):
    t = next(t for t in reader(path).tensors if t.name == name)
    want = quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(-1)
    assert np.count_nonzero(want) > want.size // 2  # real values, not an all-zero tensor
    assert_bit_exact_every_level(lib, path, name, want, f"{name} ({t.tensor_type.name})")


@pytest.mark.parametrize("path", [QWEN, GEMMA], ids=["qwen", "gemma"])
def test_every_type_of_the_file_is_checked(path):
    r = reader(path)
    present = {t.tensor_type.name for t in r.tensors}
    checked = {next(t for t in r.tensors if t.name == n).tensor_type.name for p, n in REAL if p == path}
    assert present == checked, f"types present but not checked: {present - checked}"


# fp16 scale fields (byte offsets within the block) of each random-block type.
SCALE_FIELDS = {
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
}


def random_blocks(rng, qtype, rows, n):
    """(rows, n/blck*size) uint8: random quants and scales; fp16 fields random finite halves of every
    magnitude (subnormals included), a third of them in a model-like range."""
    blck, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, n // blck, size), dtype=np.uint8)
    for off in SCALE_FIELDS[qtype]:
        h = rng.integers(0, 1 << 16, size=(rows, n // blck), dtype=np.uint16)
        h = np.where((h & 0x7c00) == 0x7c00, h & 0x83ff, h)  # inf/NaN -> finite (exponent 0)
        model_like = np.abs(rng.standard_normal((rows, n // blck)) * 0.01).astype(np.float16).view(np.uint16)
        h = np.where(rng.random((rows, n // blck)) < 1 / 3, model_like, h).astype(np.uint16)
        raw[:, :, off:off + 2] = h.view(np.uint8).reshape(rows, n // blck, 2)
    return raw.reshape(rows, -1)


def test_random_blocks_bit_exact(lib, tmp_path):
    rng = np.random.default_rng(20261201)
    path = str(tmp_path / "blocks.gguf")
    w = gguf.GGUFWriter(path, "llama")
    made = {}
    for qtype in SCALE_FIELDS:
        rows, n = 7, 1024
        data = random_blocks(rng, qtype, rows, n)
        name = f"random.{qtype.name}"
        w.add_tensor(name, data, raw_dtype=qtype)
        made[name] = (qtype, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for name, (qtype, data) in made.items():
        want = quants.dequantize(data, qtype).astype(np.float32, copy=False).reshape(-1)
        assert np.all(np.isfinite(want)) and np.count_nonzero(want) > want.size // 2
        assert_bit_exact_every_level(lib, path, name, want, f"{name}")
