"""kvpq's q8_0 / q4_0 / fp16 KV caches vs the PyPI gguf package and numpy, through the kvpq
package: what kvpq_cache_read returns must equal, bit for bit, gguf.quants.dequantize(
gguf.quants.quantize(x)) for Q8_0 and Q4_0 (ggml's block layouts and quantize_row_*_ref rounding),
and numpy's float16 round trip for fp16. Attention must match a float64 numpy softmax attention over
the read-back K/V."""
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

import kvpq  # noqa: E402

FP32, FP16, Q8_0, Q4_0 = "fp32", "fp16", "q8_0", "q4_0"


@pytest.fixture(scope="module")
def lib():
    return kvpq


def run_cache(lib, kind, k, v, q):
    """Append k, v (L, n_head_kv, head_dim) to a one-layer cache; read back; attend q (1, n_head, hd)."""
    L, hkv, hd = k.shape
    c = lib.Cache(kind, n_layer=1, n_head=q.shape[1], n_head_kv=hkv, head_dim=hd, max_seq=L)
    c.append(0, k, v)
    kr, vr = c.read(0, 0, L)
    return kr, vr, c.attend(0, q)


def data(seed, L=300, hkv=3, hd=64, n_head=9):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((L, hkv, hd)).astype(np.float32)
    v = (rng.standard_normal((L, hkv, hd)) * 3).astype(np.float32)
    k[5, 1, :] = 0.0  # an all-zero block: d = 0
    k[7, 2, 3] = -40.0  # a block whose largest magnitude is negative (q4_0 sign convention)
    q = rng.standard_normal((1, n_head, hd)).astype(np.float32)
    return k, v, q


def ref_attend(k, v, q):
    L, hkv, hd = k.shape
    n_head = q.shape[1]
    g = n_head // hkv
    out = np.empty((1, n_head, hd))
    for h in range(n_head):
        s = k[:, h // g, :].astype(np.float64) @ q[0, h].astype(np.float64) / np.sqrt(hd)
        w = np.exp(s - s.max())
        out[0, h] = (w / w.sum()) @ v[:, h // g, :].astype(np.float64)
    return out


@pytest.mark.parametrize("kind,qtype", [(Q8_0, "Q8_0"), (Q4_0, "Q4_0")])
def test_quantized_read_back_bit_exact_with_gguf(lib, kind, qtype):
    t = getattr(gguf.GGMLQuantizationType, qtype)
    for seed in range(3):
        k, v, q = data(seed)
        kr, vr, out = run_cache(lib, kind, k, v, q)
        for x, xr in ((k, kr), (v, vr)):
            want = quants.dequantize(quants.quantize(x.reshape(-1, x.shape[-1]), t), t).reshape(x.shape)
            assert np.array_equal(xr, want.astype(np.float32)), f"{qtype}: {np.abs(xr - want).max()}"
        ref = ref_attend(kr, vr, q)
        assert np.abs(out - ref).max() <= 2e-5 * np.abs(ref).max()


def test_fp16_read_back_is_numpy_float16(lib):
    k, v, q = data(7)
    k[0, 0, :4] = [65504.0, 6e-8, -3e-5, 1.0 + 2.0**-11]  # largest, subnormal, tie-to-even
    kr, vr, out = run_cache(lib, FP16, k, v, q)
    assert np.array_equal(kr, k.astype(np.float16).astype(np.float32))
    assert np.array_equal(vr, v.astype(np.float16).astype(np.float32))
    ref = ref_attend(kr, vr, q)
    assert np.abs(out - ref).max() <= 2e-5 * np.abs(ref).max()


def test_fp32_attention_matches_numpy(lib):
    k, v, q = data(9, L=1000)
    kr, vr, out = run_cache(lib, FP32, k, v, q)
    assert np.array_equal(kr, k) and np.array_equal(vr, v)
    ref = ref_attend(k, v, q)
    assert np.abs(out - ref).max() <= 2e-5 * np.abs(ref).max()


def sylvester(n):
    """Normalized Walsh-Hadamard matrix (Sylvester order), fp64: llama.cpp's ggml_gen_hadamard."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


@pytest.mark.parametrize("kind,qtype", [("q8_0r", "Q8_0"), ("q4_0r", "Q4_0")])
@pytest.mark.parametrize("hd", [64, 256])
def test_rotated_read_back_is_gguf_blocks_of_hadamard(lib, kind, qtype, hd):
    """llama.cpp's rotated KV (src/llama-kv-cache.cpp): K by H_r with r the largest power of two
    dividing head_dim, V by H_64 blocks, then ggml blocks. With integer inputs and r in {64, 256}
    (scales 1/8, 1/16) the rotation is exact in float32 and float64, so kvpq and gguf quantize the same
    vectors; the read-back is H applied to gguf's dequantization (float32 sums: 1e-6 relative)."""
    t = getattr(gguf.GGMLQuantizationType, qtype)
    rng = np.random.default_rng(hd)
    L, hkv, n_head = 100, 2, 8
    k = rng.integers(-7, 8, (L, hkv, hd)).astype(np.float32)
    v = rng.integers(-9, 10, (L, hkv, hd)).astype(np.float32)
    k[:, 0, 5] += 60  # a key channel bias, as Qwen2.5's
    q = rng.standard_normal((1, n_head, hd)).astype(np.float32) * 0.05
    kr, vr, out = run_cache(lib, kind, k, v, q)
    hk, hv = sylvester(hd), sylvester(64)
    for x, xr, h in ((k, kr, hk), (v, vr, hv)):
        r = h.shape[0]
        y = (x.reshape(-1, r).astype(np.float64) @ h.T).astype(np.float32)  # exact
        d = quants.dequantize(quants.quantize(y.reshape(-1, hd), t), t).reshape(-1, r).astype(np.float64)
        want = (d @ h.T).reshape(x.shape)
        assert np.abs(xr - want).max() <= 1e-6 * np.abs(want).max()
    ref = ref_attend(kr, vr, q)
    assert np.abs(out - ref).max() <= 2e-5 * np.abs(ref).max()
