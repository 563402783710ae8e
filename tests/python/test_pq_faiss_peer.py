"""kvpq's product quantizer vs faiss-cpu (a peer we did not write), through ctypes on KVPQ_LIB.

- encode: with faiss's trained centroids loaded as SUBSPACE codebooks, kvpq_pq_encode gives the same
  packed bytes as faiss ProductQuantizer.compute_codes (both: little-endian bit stream); a differing
  code is allowed only where the two centroids' exact distances are within float rounding.
- decode: kvpq_pq_decode equals faiss ProductQuantizer.decode.
- kmeans: kvpq_kmeans's final MSE is within 2% of faiss.Kmeans's on the same data, k and niter
  (the seed-to-seed spread of either is ~0.5% on this data)."""
import ctypes as C
import os

import numpy as np
import pytest

# Two OpenMP runtimes share this process (faiss wheels bundle their own): idle threads must sleep,
# not spin, or each steals the other's cores on the 2-core CI machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
faiss = pytest.importorskip("faiss")
LIB = os.environ.get("KVPQ_LIB")
pytestmark = pytest.mark.skipif(not LIB, reason="KVPQ_LIB not set (run through ctest)")
QUICK = os.environ.get("KVPQ_QUICK", "0") not in ("", "0")

TIE_REL = 1e-5  # exact-distance gap allowed where codes differ, relative to ||x||^2 + ||c||^2


class PQParams(C.Structure):
    _fields_ = [("d", C.c_int), ("M", C.c_int), ("nbits", C.c_int), ("granularity", C.c_int)]


PROGRESS = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_char_p, C.c_double, C.c_double)


class KMParams(C.Structure):
    _fields_ = [("niter", C.c_int), ("max_points_per_centroid", C.c_int), ("seed", C.c_uint64),
                ("n_threads", C.c_int), ("progress", PROGRESS), ("progress_user", C.c_void_p),
                ("init", C.c_int)]


class KMReport(C.Structure):
    _fields_ = [("mse_init", C.c_double), ("mse_final", C.c_double), ("iterations", C.c_int),
                ("empty_repaired", C.c_int), ("n_used", C.c_size_t)]


@pytest.fixture(scope="module")
def lib():
    L = C.CDLL(LIB)
    L.kvpq_last_error.restype = C.c_char_p
    L.kvpq_pq_new.argtypes = [C.POINTER(C.c_void_p), C.POINTER(PQParams)]
    L.kvpq_pq_free.argtypes = [C.c_void_p]
    L.kvpq_pq_set_centroids.argtypes = [C.c_void_p, C.c_void_p, C.c_size_t]
    L.kvpq_pq_encode.argtypes = [C.c_void_p, C.c_size_t, C.c_void_p, C.c_void_p]
    L.kvpq_pq_decode.argtypes = [C.c_void_p, C.c_size_t, C.c_void_p, C.c_void_p]
    L.kvpq_pq_code_size.argtypes = [C.c_void_p]
    L.kvpq_pq_code_size.restype = C.c_size_t
    L.kvpq_kmeans.argtypes = [C.c_int, C.c_int, C.c_size_t, C.c_void_p, C.POINTER(KMParams), C.c_void_p,
                              C.POINTER(KMReport)]
    return L


def ptr(a):
    return a.ctypes.data_as(C.c_void_p)


def keys_like(n, d, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d), dtype=np.float32)
    x[:, :: max(1, d // 8)] *= 4.0  # heavy channels
    return np.ascontiguousarray(x)


def unpack(codes, M, nbits):
    bits = np.unpackbits(codes, axis=1, bitorder="little")[:, : M * nbits].reshape(len(codes), M, nbits)
    return (bits.astype(np.int64) << np.arange(nbits)).sum(-1)


@pytest.mark.parametrize("d,M,nbits", [(64, 16, 8), (64, 8, 8), (64, 32, 8), (64, 16, 4), (32, 8, 6),
                                       (64, 4, 10), (16, 1, 8)])
def test_encode_decode_match_faiss(lib, d, M, nbits):
    n = 500 if QUICK else 3000
    x = keys_like(n, d, nbits * 100 + M)
    pq = faiss.ProductQuantizer(d, M, nbits)
    pq.cp.min_points_per_centroid = 1
    pq.train(keys_like(max(4 << nbits, 2000), d, 7))
    cent = faiss.vector_to_array(pq.centroids).astype(np.float32)  # (M, ksub, dsub)
    h = C.c_void_p()
    assert lib.kvpq_pq_new(C.byref(h), C.byref(PQParams(d, M, nbits, 1))) == 0, lib.kvpq_last_error()
    try:
        assert lib.kvpq_pq_set_centroids(h, ptr(cent), cent.size) == 0
        cs = lib.kvpq_pq_code_size(h)
        ours = np.zeros((n, cs), np.uint8)
        assert lib.kvpq_pq_encode(h, n, ptr(x), ptr(ours)) == 0, lib.kvpq_last_error()
        theirs = pq.compute_codes(x)
        assert theirs.shape == ours.shape
        a, b = unpack(ours, M, nbits), unpack(theirs, M, nbits)
        diff = np.argwhere(a != b)
        assert len(diff) <= max(2, a.size // 1000), f"{len(diff)} of {a.size} codes differ"
        dsub, ksub = d // M, 1 << nbits
        C3 = cent.reshape(M, ksub, dsub)
        for i, m in diff:  # only near-ties may differ
            xs = x[i, m * dsub:(m + 1) * dsub].astype(np.float64)
            ca, cb = C3[m, a[i, m]].astype(np.float64), C3[m, b[i, m]].astype(np.float64)
            gap = abs(((xs - ca) ** 2).sum() - ((xs - cb) ** 2).sum())
            assert gap <= TIE_REL * ((xs ** 2).sum() + (ca ** 2).sum() + (cb ** 2).sum())
        y = np.zeros_like(x)
        assert lib.kvpq_pq_decode(h, n, ptr(ours), ptr(y)) == 0
        np.testing.assert_array_equal(y, pq.decode(ours))
    finally:
        lib.kvpq_pq_free(h)


@pytest.mark.parametrize("d,k", [(4, 64), (8, 128), (2, 32)])
def test_kmeans_mse_on_par_with_faiss(lib, d, k):
    n = 4000 if QUICK else 20000
    x = keys_like(n, d, 11 * d + k)
    km = faiss.Kmeans(d, k, niter=20, seed=5, max_points_per_centroid=256, verbose=False)
    km.cp.min_points_per_centroid = 1
    km.train(x)
    cent = np.zeros((k, d), np.float32)
    rep = KMReport()
    kp = KMParams(20, 256, 5, 0, PROGRESS(0), None)
    assert lib.kvpq_kmeans(d, k, n, ptr(x), C.byref(kp), ptr(cent), C.byref(rep)) == 0, lib.kvpq_last_error()

    def mse(c):
        index = faiss.IndexFlatL2(d)
        index.add(c)
        return float(index.search(x, 1)[0].mean())

    ours, theirs = mse(cent), mse(km.centroids)
    assert ours <= 1.02 * theirs, f"kvpq MSE {ours} vs faiss {theirs}"
    used = min(n, 256 * k)
    assert rep.n_used == used
    if used == n:  # the reported MSE is the MSE of the returned codebook
        assert abs(rep.mse_final - ours) <= 1e-3 * ours
