"""TurboQuant's MSE quantizer as a kvpq codebook (kvpq.h: kvpq_turboquant_centroids,
kvpq_codebook_turboquant; Zandieh et al., arXiv 2504.19874), a peer in kvpq's own harness."""
from typing import TYPE_CHECKING

import numpy as np

from ._ffi import ffi, lib

if TYPE_CHECKING:
    from ._core import Codebook


def turboquant_centroids(d: int, bits: int) -> np.ndarray:
    """The 2**bits Lloyd-Max centroids (ascending, float32) for one coordinate of a uniformly random
    unit vector in R^d (density ~ (1 - x^2)^((d - 3) / 2) on [-1, 1]). Raises kvpq.Error for d < 4 or
    bits outside 1..8."""
    from ._core import _check, _int
    d, bits = _int(d, "d", "turboquant_centroids", 4), _int(bits, "bits", "turboquant_centroids", 1, 8)
    out = np.empty(1 << bits, np.float32)
    _check(lib.kvpq_turboquant_centroids(d, bits, ffi.cast("float *", out.ctypes.data)), "turboquant_centroids")
    return out


def turboquant_codebook(n_layer: int, n_head_kv: int, head_dim: int, bits: int, norm_bits: int = 16) -> "Codebook":
    """A Codebook that makes the VQ cache TurboQuant's MSE quantizer at `bits` per coordinate:
    Hadamard-rotated keys and values, norm-explicit, each coordinate of the direction coded by
    turboquant_centroids(head_dim, bits). Its window and sinks are 0 (alloc.window / alloc.sinks) unless
    the cache overrides them. Effective bits per element: bits + norm_bits / head_dim."""
    from ._core import Codebook, _check, _int
    w = "turboquant_codebook"
    h = ffi.new("kvpq_codebook **")
    _check(lib.kvpq_codebook_turboquant(h, _int(n_layer, "n_layer", w, 1), _int(n_head_kv, "n_head_kv", w, 1),
                                        _int(head_dim, "head_dim", w, 1), _int(bits, "bits", w, 1, 8),
                                        _int(norm_bits, "norm_bits", w, 8, 16)), w)
    return Codebook(0, 0, 0, _handle=h[0])
