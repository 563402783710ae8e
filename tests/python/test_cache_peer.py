"""kvpq's q8_0 / q4_0 / fp16 KV caches vs the PyPI gguf package and numpy, through ctypes on
KVPQ_LIB: what kvpq_cache_read returns must equal, bit for bit, gguf.quants.dequantize(
gguf.quants.quantize(x)) for Q8_0 and Q4_0 (ggml's block layouts and quantize_row_*_ref rounding),
and numpy's float16 round trip for fp16. Attention must match a float64 numpy softmax attention over
the read-back K/V."""
import ctypes
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

LIB = os.environ.get("KVPQ_LIB")
pytestmark = pytest.mark.skipif(not LIB, reason="KVPQ_LIB not set (run through ctest)")

FP32, FP16, Q8_0, Q4_0 = 0, 1, 2, 3


class CacheParams(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("n_layer", ctypes.c_int), ("n_head", ctypes.c_int),
                ("n_head_kv", ctypes.c_int), ("head_dim", ctypes.c_int), ("max_seq", ctypes.c_int),
                ("window", ctypes.c_int), ("page_tokens", ctypes.c_int), ("codebook", ctypes.c_void_p),
                ("n_threads", ctypes.c_int), ("backend", ctypes.c_int), ("vq_fast_scan", ctypes.c_int),
                ("sliding_window", ctypes.c_int), ("swa_layers", ctypes.c_void_p)]  # all of include/kvpq.h's


FP = ctypes.POINTER(ctypes.c_float)


@pytest.fixture(scope="module")
def lib():
    L = ctypes.CDLL(LIB)
    L.kvpq_cache_params_default.restype = CacheParams
    L.kvpq_cache_new.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(CacheParams)]
    L.kvpq_cache_free.argtypes = [ctypes.c_void_p]
    L.kvpq_cache_append.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, FP, FP]
    L.kvpq_cache_read.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, FP, FP]
    L.kvpq_cache_attend.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, FP, FP]
    L.kvpq_last_error.restype = ctypes.c_char_p
    return L


def fptr(a):
    return a.ctypes.data_as(FP)


def run_cache(lib, kind, k, v, q):
    """Append k, v (L, n_head_kv, head_dim) to a one-layer cache; read back; attend q (1, n_head, hd)."""
    L, hkv, hd = k.shape
    p = lib.kvpq_cache_params_default()
    p.type, p.n_layer, p.n_head, p.n_head_kv, p.head_dim, p.max_seq = kind, 1, q.shape[1], hkv, hd, L
    c = ctypes.c_void_p()
    assert lib.kvpq_cache_new(ctypes.byref(c), ctypes.byref(p)) == 0, lib.kvpq_last_error().decode()
    try:
        assert lib.kvpq_cache_append(c, 0, L, fptr(k), fptr(v)) == 0, lib.kvpq_last_error().decode()
        kr, vr = np.empty_like(k), np.empty_like(v)
        assert lib.kvpq_cache_read(c, 0, 0, L, fptr(kr), fptr(vr)) == 0
        out = np.empty_like(q)
        assert lib.kvpq_cache_attend(c, 0, 1, fptr(q), fptr(out)) == 0
        return kr, vr, out
    finally:
        lib.kvpq_cache_free(c)


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
