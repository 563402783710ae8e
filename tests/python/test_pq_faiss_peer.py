"""kvpq's product quantizer vs faiss-cpu (a peer we did not write), through the kvpq package.

- encode: with faiss's trained centroids loaded as SUBSPACE codebooks, kvpq_pq_encode gives the same
  packed bytes as faiss ProductQuantizer.compute_codes (both: little-endian bit stream); a differing
  code is allowed only where the two centroids' exact distances are within float rounding.
- decode: kvpq_pq_decode equals faiss ProductQuantizer.decode.
- kmeans: kvpq_kmeans's final MSE is within 2% of faiss.Kmeans's on the same data, k and niter
  (the seed-to-seed spread of either is ~0.5% on this data)."""
import os

import numpy as np
import pytest

# Two OpenMP runtimes share this process (faiss wheels bundle their own): idle threads must sleep,
# not spin, or each steals the other's cores on the 2-core CI machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
faiss = pytest.importorskip("faiss")
import kvpq  # noqa: E402

QUICK = os.environ.get("KVPQ_QUICK", "0") not in ("", "0")

TIE_REL = 1e-5  # exact-distance gap allowed where codes differ, relative to ||x||^2 + ||c||^2


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
def test_encode_decode_match_faiss(d, M, nbits):
    n = 500 if QUICK else 3000
    x = keys_like(n, d, nbits * 100 + M)
    pq = faiss.ProductQuantizer(d, M, nbits)
    pq.cp.min_points_per_centroid = 1
    pq.train(keys_like(max(4 << nbits, 2000), d, 7))
    cent = faiss.vector_to_array(pq.centroids).astype(np.float32)  # (M, ksub, dsub)
    h = kvpq.ProductQuantizer(d, M, nbits, granularity="subspace")
    h.centroids = cent.reshape(M, 1 << nbits, d // M)
    ours = h.encode(x)
    assert ours.shape == (n, h.code_size)
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
    np.testing.assert_array_equal(h.decode(ours), pq.decode(ours))
    np.testing.assert_array_equal(h.assign(x), a)


@pytest.mark.parametrize("d,k", [(4, 64), (8, 128), (2, 32)])
def test_kmeans_mse_on_par_with_faiss(d, k):
    n = 4000 if QUICK else 20000
    x = keys_like(n, d, 11 * d + k)
    km = faiss.Kmeans(d, k, niter=20, seed=5, max_points_per_centroid=256, verbose=False)
    km.cp.min_points_per_centroid = 1
    km.train(x)
    cent, rep = kvpq.kmeans(x, k, niter=20, seed=5, max_points_per_centroid=256, init="pp")

    def mse(c):
        index = faiss.IndexFlatL2(d)
        index.add(c)
        return float(index.search(x, 1)[0].mean())

    ours, theirs = mse(cent), mse(km.centroids)
    assert ours <= 1.02 * theirs, f"kvpq MSE {ours} vs faiss {theirs}"
    used = min(n, 256 * k)
    assert rep["n_used"] == used
    if used == n:  # the reported MSE is the MSE of the returned codebook
        assert abs(rep["mse_final"] - ours) <= 1e-3 * ours
