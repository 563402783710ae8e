"""numpy API over libkvpq: quantizers, codebooks, caches, key transforms, models, calibration.

Conventions (as the C API, include/kvpq.h):
  - arrays are numpy arrays of the stated dtype (float32 unless said), shapes (outer, ..., inner).
    Input is converted as numpy converts: lists and other array-likes (np.asarray), float64 or
    float16 to float32, integers to the stated integer type when the values fit, any layout to C
    order (not a broadcast view: its copy could be of any size). What numpy's 'same_kind' casting
    refuses (float to integer codes, complex, bool, object), a wrong shape, integers out of range
    or a NaN/Inf raises kvpq.ArgumentError (a kvpq.Error and a ValueError) naming the argument;
  - functions return new arrays; inputs are never modified;
  - every failing library call raises kvpq.Error carrying the kvpq_status, its name and the
    library's kvpq_last_error() text.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ._ffi import ffi, lib

PathLike = Union[str, "os.PathLike[str]"]
QuantizerSpec = Union[str, Tuple[int, int]]  # a preset name ("d4b8") or (M, nbits)

# ---- errors ------------------------------------------------------------------------------------

OK = lib.KVPQ_OK
ERR_INVALID_ARG = lib.KVPQ_ERR_INVALID_ARG
ERR_NONFINITE = lib.KVPQ_ERR_NONFINITE


class Error(RuntimeError):
    """A kvpq failure (a RuntimeError). status: the kvpq_status (negative int); status_name: its fixed
    name ("invalid argument", ...); detail: the kvpq_last_error() text, or the binding's own message
    for a check made before calling the library (argument dtype, shape, NaN); where: the function.
    A bad argument (status invalid argument, NaN/Inf or mismatch) is raised as ArgumentError, a
    subclass that is also a ValueError: Error(status, ...) itself picks the class from the status."""

    def __new__(cls, status, *args, **kwargs):
        if cls is Error and int(status) in _ARGUMENT_STATUSES:
            cls = ArgumentError
        return super().__new__(cls, status, *args, **kwargs)

    def __init__(self, status: int, detail: str, where: str = "") -> None:
        self.status = int(status)
        self.status_name = ffi.string(lib.kvpq_status_string(self.status)).decode()
        self.detail = detail
        self.where = where
        prefix = f"{where}: " if where else ""
        super().__init__(f"{prefix}{detail} [{self.status_name} ({self.status})]")


class ArgumentError(Error, ValueError):
    """A bad argument: KVPQ_ERR_INVALID_ARG, KVPQ_ERR_NONFINITE or KVPQ_ERR_MISMATCH (a kvpq.Error
    and a ValueError)."""


_ARGUMENT_STATUSES = {ERR_INVALID_ARG, ERR_NONFINITE, lib.KVPQ_ERR_MISMATCH}


def _check(status, where):
    if status != OK:
        raise Error(status, ffi.string(lib.kvpq_last_error()).decode("utf-8", "replace"), where)


def _arg_error(where, msg, status=ERR_INVALID_ARG):
    return Error(status, msg, where)


def _as_array(x, name, where, want):
    """x as a numpy array of dtype `want`, converted as numpy users expect: a list, tuple or other
    array-like through np.asarray; another float or integer dtype that numpy's 'same_kind' casting
    allows (float64 or float16 to float32, integers to float32), and integers of any width or sign to
    the stated integer type when every value fits.
    Everything else (bool, complex, object, float to integer) is refused, naming the argument, and so
    is a broadcast (zero-stride) view, whose copy could need any amount of memory."""
    if not isinstance(x, np.ndarray):
        if isinstance(x, (str, bytes)) or x is None:
            raise _arg_error(where, f"{name}: expected an array of {want.name}, got {type(x).__name__}")
        try:
            x = np.asarray(x)
        except (ValueError, TypeError) as e:
            raise _arg_error(where, f"{name}: not convertible to an array ({e})") from None
    if any(st == 0 and n > 1 for st, n in zip(x.strides, x.shape)):
        # a broadcast view: its copy may need any amount of memory (numpy's broadcast_to is free)
        raise _arg_error(where, f"{name}: a broadcast (zero-stride) array of shape {tuple(x.shape)}; pass "
                                f"np.ascontiguousarray({name}) if that copy is meant")
    if x.dtype == want:
        return x
    ints = x.dtype.kind in "iu" and want.kind in "iu"  # any width or sign, checked below to fit
    if not ints and (x.dtype.kind not in "iuf" or not np.can_cast(x.dtype, want, "same_kind")):
        raise _arg_error(where, f"{name}: expected dtype {want.name}, got {x.dtype.name} "
                                f"(numpy would not cast it: convert it yourself if that is meant)")
    if want.kind in "iu" and x.size:
        lo, hi = np.iinfo(want).min, np.iinfo(want).max
        if x.min() < lo or x.max() > hi:
            raise _arg_error(where, f"{name}: values {x.min()}..{x.max()} do not fit {want.name} ({lo}..{hi})")
    return x.astype(want)


def _array(x, name, where, dtype=np.float32, shape=None, finite=True):
    """An argument array, checked and converted (_as_array): dtype, then shape (a tuple; None matches
    any size), then C order (a copy when not), then (for floats) finite. Returns the array to pass on:
    x itself when it already was C-contiguous of `dtype`, else a converted copy (x is never modified)."""
    x = _as_array(x, name, where, np.dtype(dtype))
    if shape is not None:
        ok = x.ndim == len(shape) and all(w is None or w == g for w, g in zip(shape, x.shape))
        if not ok:
            want = "(" + ", ".join("*" if w is None else str(w) for w in shape) + ")"
            raise _arg_error(where, f"{name}: expected shape {want}, got {tuple(x.shape)}")
    x = np.require(x, requirements=["C", "A"])  # a copy only when not C-contiguous and aligned
    if finite and x.dtype.kind == "f" and x.size and not np.isfinite(x).all():
        i = np.unravel_index(int(np.argmin(np.isfinite(x).ravel())), x.shape)
        raise _arg_error(where, f"{name}: holds NaN or Inf (first at index {tuple(int(j) for j in i)})", ERR_NONFINITE)
    return x


def _ptr(a, ctype="float *"):
    return ffi.cast(ctype, a.ctypes.data) if a is not None else ffi.NULL


INT_MAX = 2 ** 31 - 1


def _int(v, name, where, lo=None, hi=INT_MAX):
    """An int argument within [lo, hi] (hi: C int's maximum unless said), else kvpq.Error naming it
    (never cffi's OverflowError)."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise _arg_error(where, f"{name}: expected an int, got {type(v).__name__}")
    v = int(v)
    if lo is None:
        lo = -INT_MAX - 1
    if v < lo:
        raise _arg_error(where, f"{name}: {v} is below {lo}")
    if v > hi:
        raise _arg_error(where, f"{name}: {v} is above {hi}")
    return v


def _dim(x, axis, name, where):
    """x.shape[axis] as a C int (a zero-size array may have a dimension beyond it)."""
    return _int(x.shape[axis], f"{name}.shape[{axis}]", where, 0)


def _text(text, where):
    """str (encoded as UTF-8) or bytes-like -> bytes, else kvpq.Error naming `text`."""
    if isinstance(text, str):
        return text.encode("utf-8", "surrogatepass")
    if isinstance(text, (bytes, bytearray, memoryview)):
        return bytes(text)
    raise _arg_error(where, f"text: expected str or bytes, got {type(text).__name__}")


def _str(p):
    return None if p == ffi.NULL else ffi.string(p).decode("utf-8", "replace")


def version() -> str:
    """Library version "MAJOR.MINOR.PATCH"."""
    return _str(lib.kvpq_version())


def last_error() -> str:
    """kvpq_last_error(): detail of the last failing call on this thread ("" if none)."""
    return _str(lib.kvpq_last_error())


# ---- SIMD level ---------------------------------------------------------------------------------

SIMD_LEVELS = {"scalar": lib.KVPQ_SIMD_SCALAR, "avx2": lib.KVPQ_SIMD_AVX2, "avx512": lib.KVPQ_SIMD_AVX512}


def simd_get() -> str:
    """Name of the CPU kernels' SIMD level in use ("scalar", "avx2", "avx512")."""
    return _str(lib.kvpq_simd_name(lib.kvpq_simd_get()))


def simd_set(level: str) -> None:
    """Force a SIMD level by name. Raises kvpq.Error (unsupported) if the CPU lacks it."""
    if level not in SIMD_LEVELS:
        raise _arg_error("simd_set", f"level: '{level}' is not one of {sorted(SIMD_LEVELS)}")
    _check(lib.kvpq_simd_set(SIMD_LEVELS[level]), "simd_set")


# ---- product quantizer --------------------------------------------------------------------------

_GRAN = {"shared": lib.KVPQ_CODEBOOK_SHARED, "subspace": lib.KVPQ_CODEBOOK_SUBSPACE, "head": lib.KVPQ_CODEBOOK_HEAD}
_GRAN_NAME = {v: k for k, v in _GRAN.items()}
_INIT = {"pp": lib.KVPQ_KMEANS_INIT_PP, "random": lib.KVPQ_KMEANS_INIT_RANDOM}


def _pq_params(where, d, M=None, nbits=None, granularity="shared", preset=None, n_head=0):
    p = ffi.new("kvpq_pq_params *", lib.kvpq_pq_params_default())
    d = _int(d, "d", where, 1)
    if preset is not None:
        _check(lib.kvpq_pq_params_preset(p, preset.encode(), d), where)
    else:
        p.d = d
        if M is not None:
            p.M = _int(M, "M", where, 1)
        if nbits is not None:
            p.nbits = _int(nbits, "nbits", where, 1)
    if granularity not in _GRAN:
        raise _arg_error(where, f"granularity: '{granularity}': expected 'shared', 'subspace' or 'head'")
    p.granularity = _GRAN[granularity]
    p.n_head = _int(n_head, "n_head", where, 0)
    return p


def _kmeans_params(where, niter, seed, max_points_per_centroid, init, n_threads, base=None):
    kp = ffi.new("kvpq_kmeans_params *", base if base is not None else lib.kvpq_kmeans_params_default())
    if niter is not None:
        kp.niter = _int(niter, "niter", where, 1)
    if seed is not None:
        kp.seed = _int(seed, "seed", where, 0, 2 ** 64 - 1)
    if max_points_per_centroid is not None:
        kp.max_points_per_centroid = _int(max_points_per_centroid, "max_points_per_centroid", where, 0)
    if init is not None:
        if init not in _INIT:
            raise _arg_error(where, f"init: '{init}': expected 'pp' or 'random'")
        kp.init = _INIT[init]
    if n_threads is not None:
        kp.n_threads = _int(n_threads, "n_threads", where, 0)
    return kp


def _report(r):
    return {"mse_init": r.mse_init, "mse_final": r.mse_final, "iterations": r.iterations,
            "empty_repaired": r.empty_repaired, "n_used": int(r.n_used)}


class ProductQuantizer:
    """A product quantizer (kvpq_pq): vectors of d dims split into M sub-vectors of dsub = d / M
    dims, each coded by the index of its nearest of ksub = 2**nbits centroids (Jegou et al., TPAMI
    2011). granularity "shared": one (ksub, dsub) codebook for every sub-space (VecInfer);
    "subspace": (M, ksub, dsub), as faiss. ProductQuantizer(d, preset="d4b8") takes M and nbits from
    a preset ("d8b8" 1 bit/element, "d8b12" 1.5, "d4b8" 2, "d4b12" 3, "d2b8" 4, "d1b8" 8). granularity "head":
    (n_head, ksub, dsub), one codebook per head; rows given to encode/decode/train interleave the
    heads (row i is head i % n_head)."""

    def __init__(self, d: int = 64, M: int = 16, nbits: int = 8, granularity: str = "shared",
                 preset: Optional[str] = None, n_head: int = 0, _borrow: Any = None) -> None:
        if _borrow is not None:
            self._h, self._owner = _borrow
            return
        p = _pq_params("ProductQuantizer", d, M if preset is None else None, nbits if preset is None else None,
                       granularity, preset, n_head)
        h = ffi.new("kvpq_pq **")
        _check(lib.kvpq_pq_new(h, p), "ProductQuantizer")
        self._h = ffi.gc(h[0], lib.kvpq_pq_free)
        self._owner = None

    @property
    def params(self) -> Any:
        return lib.kvpq_pq_get_params(self._h)

    @property
    def d(self) -> int:
        return self.params.d

    @property
    def M(self) -> int:
        return self.params.M

    @property
    def nbits(self) -> int:
        return self.params.nbits

    @property
    def dsub(self) -> int:
        return self.params.d // self.params.M

    @property
    def ksub(self) -> int:
        return 1 << self.params.nbits

    @property
    def granularity(self) -> str:
        return _GRAN_NAME[self.params.granularity]

    @property
    def code_size(self) -> int:
        return int(lib.kvpq_pq_code_size(self._h))

    def _shape(self):
        g = self.granularity
        lead = () if g == "shared" else (self.M,) if g == "subspace" else (self.params.n_head,)
        return lead + (self.ksub, self.dsub)

    def __repr__(self):
        return (f"ProductQuantizer(d={self.d}, M={self.M}, nbits={self.nbits}, "
                f"granularity='{self.granularity}')")

    @property
    def centroids(self) -> NDArray[np.float32]:
        """Copy of the centroids: (ksub, dsub) shared or (M, ksub, dsub) subspace, float32."""
        n = int(lib.kvpq_pq_centroids_size(self._h))
        buf = ffi.buffer(lib.kvpq_pq_centroids(self._h), n * 4)
        return np.frombuffer(buf, dtype=np.float32).reshape(self._shape()).copy()

    @centroids.setter
    def centroids(self, c: ArrayLike) -> None:
        c = _array(c, "centroids", "ProductQuantizer.centroids", shape=self._shape())
        _check(lib.kvpq_pq_set_centroids(self._h, _ptr(c), c.size), "ProductQuantizer.centroids")

    def train(self, x: ArrayLike, niter: Optional[int] = None, seed: Optional[int] = None,
              max_points_per_centroid: Optional[int] = None, init: Optional[str] = None,
              n_threads: Optional[int] = None) -> Dict[str, Any]:
        """Train the codebook(s) by k-means on x: (n, d) float32 (kvpq_pq_train; defaults of
        kvpq_kmeans_params_default: 25 iterations, seed 1234, k-means++ init, 256 points per
        centroid). Returns the k-means report as a dict (mse_init, mse_final per d-dim vector,
        iterations, empty_repaired, n_used)."""
        x = _array(x, "x", "ProductQuantizer.train", shape=(None, self.d))
        kp = _kmeans_params("ProductQuantizer.train", niter, seed, max_points_per_centroid, init, n_threads)
        r = ffi.new("kvpq_kmeans_report *")
        _check(lib.kvpq_pq_train(self._h, kp, x.shape[0], _ptr(x), r), "ProductQuantizer.train")
        return _report(r)

    def encode(self, x: ArrayLike) -> NDArray[np.uint8]:
        """x: (n, d) float32 -> packed codes (n, code_size) uint8 (code m in bits [m*nbits, (m+1)*nbits)
        of a little-endian bit stream)."""
        x = _array(x, "x", "ProductQuantizer.encode", shape=(None, self.d))
        codes = np.empty((x.shape[0], self.code_size), np.uint8)
        _check(lib.kvpq_pq_encode(self._h, x.shape[0], _ptr(x), _ptr(codes, "uint8_t *")), "ProductQuantizer.encode")
        return codes

    def assign(self, x: ArrayLike) -> NDArray[np.uint16]:
        """x: (n, d) float32 -> centroid indices (n, M) uint16 (unpacked codes)."""
        x = _array(x, "x", "ProductQuantizer.assign", shape=(None, self.d))
        idx = np.empty((x.shape[0], self.M), np.uint16)
        _check(lib.kvpq_pq_assign(self._h, x.shape[0], _ptr(x), _ptr(idx, "uint16_t *")), "ProductQuantizer.assign")
        return idx

    def decode(self, codes: ArrayLike) -> NDArray[np.float32]:
        """codes: (n, code_size) uint8 -> reconstructions (n, d) float32."""
        codes = _array(codes, "codes", "ProductQuantizer.decode", dtype=np.uint8, shape=(None, self.code_size))
        x = np.empty((codes.shape[0], self.d), np.float32)
        _check(lib.kvpq_pq_decode(self._h, codes.shape[0], _ptr(codes, "uint8_t *"), _ptr(x)),
               "ProductQuantizer.decode")
        return x


def kmeans(x: ArrayLike, k: int, niter: Optional[int] = None, seed: Optional[int] = None,
           max_points_per_centroid: Optional[int] = None, init: Optional[str] = None,
           n_threads: Optional[int] = None) -> Tuple[NDArray[np.float32], Dict[str, Any]]:
    """k-means of x: (n, d) float32 into k centroids (kvpq_kmeans). Returns (centroids (k, d),
    report dict)."""
    x = _array(x, "x", "kmeans", shape=(None, None))
    k = _int(k, "k", "kmeans", 1)
    kp = _kmeans_params("kmeans", niter, seed, max_points_per_centroid, init, n_threads)
    d = _dim(x, 1, "x", "kmeans")
    if k > x.shape[0]:
        raise _arg_error("kmeans", f"k: {k} centroids from {x.shape[0]} vectors of x")
    cent = np.empty((k, d), np.float32)
    r = ffi.new("kvpq_kmeans_report *")
    _check(lib.kvpq_kmeans(d, k, x.shape[0], _ptr(x), kp, _ptr(cent), r), "kmeans")
    return cent, _report(r)


def codes_pack(idx: ArrayLike, nbits: int) -> NDArray[np.uint8]:
    """Pack idx (n, M) uint16 (each < 2**nbits) into (n, ceil(M*nbits/8)) uint8."""
    idx = _array(idx, "idx", "codes_pack", dtype=np.uint16, shape=(None, None))
    M = _dim(idx, 1, "idx", "codes_pack")
    nbits = _int(nbits, "nbits", "codes_pack", 1, 16)
    out = np.empty((idx.shape[0], int(lib.kvpq_codes_size(M, nbits))), np.uint8)
    _check(lib.kvpq_codes_pack(M, nbits, idx.shape[0], _ptr(idx, "uint16_t *"), _ptr(out, "uint8_t *")),
           "codes_pack")
    return out


def codes_unpack(packed: ArrayLike, M: int, nbits: int) -> NDArray[np.uint16]:
    """Unpack (n, ceil(M*nbits/8)) uint8 into idx (n, M) uint16."""
    M = _int(M, "M", "codes_unpack", 1)
    nbits = _int(nbits, "nbits", "codes_unpack", 1, 16)
    size = int(lib.kvpq_codes_size(M, nbits))
    packed = _array(packed, "packed", "codes_unpack", dtype=np.uint8, shape=(None, size))
    idx = np.empty((packed.shape[0], M), np.uint16)
    _check(lib.kvpq_codes_unpack(M, nbits, packed.shape[0], _ptr(packed, "uint8_t *"), _ptr(idx, "uint16_t *")),
           "codes_unpack")
    return idx


# ---- key transforms (VecInfer sec. 3) -------------------------------------------------------------

def hadamard(x: ArrayLike) -> NDArray[np.float32]:
    """Normalized Walsh-Hadamard transform (Sylvester order, scaled by 1/sqrt(d); orthonormal and
    self-inverse) of every last-axis vector of x: (..., d) float32, d a power of two. Returns a new
    array."""
    x = _array(x, "x", "hadamard")
    if x.ndim < 1:
        raise _arg_error("hadamard", "x: expected at least 1 dimension")
    y = x.copy()
    d = _dim(x, -1, "x", "hadamard")
    _check(lib.kvpq_hadamard(_ptr(y), y.size // d if d else 0, d), "hadamard")
    return y


def normalize_rows(x: ArrayLike) -> Tuple[NDArray[np.float32], NDArray[np.float32]]:
    """Unit directions of the last-axis vectors of x: (..., d) float32. Returns (u, norms) with u
    the shape of x (zero rows stay zero) and norms (...) the L2 norms."""
    x = _array(x, "x", "normalize_rows")
    if x.ndim < 1:
        raise _arg_error("normalize_rows", "x: expected at least 1 dimension")
    d = _dim(x, -1, "x", "normalize_rows")
    if d < 1:  # before allocating norms of shape x.shape[:-1], which a zero-size x may make huge
        raise _arg_error("normalize_rows", f"x: last dimension is 0 (shape {tuple(x.shape)})")
    u = x.copy()
    norms = np.empty(x.shape[:-1], np.float32)
    _check(lib.kvpq_normalize_rows(_ptr(u), u.size // d if d else 0, d, _ptr(norms)), "normalize_rows")
    return u, norms


def smooth_compute(k: ArrayLike, floor: float = 1e-2) -> NDArray[np.float32]:
    """Key smoothing factors lambda = sqrt(max_t |k_t|) per KV head and channel, floored at
    `floor` (VecInfer sec. 3). k: (n_tokens, n_head_kv, head_dim) float32 -> (n_head_kv, head_dim)."""
    k = _array(k, "k", "smooth_compute", shape=(None, None, None))
    h, d = _dim(k, 1, "k", "smooth_compute"), _dim(k, 2, "k", "smooth_compute")
    if not isinstance(floor, (int, float, np.integer, np.floating)) or isinstance(floor, (bool, np.bool_)):
        raise _arg_error("smooth_compute", f"floor: expected a number, got {type(floor).__name__}")
    lam = np.empty(k.shape[1:], np.float32)
    _check(lib.kvpq_smooth_compute(k.shape[0], h, d, _ptr(k), float(floor), _ptr(lam)),
           "smooth_compute")
    return lam


def smooth_apply(x: ArrayLike, lam: ArrayLike, inverse: bool = False) -> NDArray[np.float32]:
    """x / lambda (inverse=False: what keys get before rotation) or x * lambda (inverse=True).
    x: (n, n_head_kv, head_dim), lam: (n_head_kv, head_dim), float32. Returns a new array."""
    x = _array(x, "x", "smooth_apply", shape=(None, None, None))
    lam = _array(lam, "lam", "smooth_apply", shape=x.shape[1:])
    h, d = _dim(x, 1, "x", "smooth_apply"), _dim(x, 2, "x", "smooth_apply")
    y = x.copy()
    _check(lib.kvpq_smooth_apply(_ptr(y), y.shape[0], h, d, _ptr(lam), int(bool(inverse))),
           "smooth_apply")
    return y


def smooth_apply_query(q: ArrayLike, lam: ArrayLike) -> NDArray[np.float32]:
    """Queries times the factors of their KV head (GQA: head h uses row h // (n_head // n_head_kv)),
    so (q * lambda) . (k / lambda) = q . k. q: (n, n_head, head_dim), lam: (n_head_kv, head_dim)."""
    q = _array(q, "q", "smooth_apply_query", shape=(None, None, None))
    lam = _array(lam, "lam", "smooth_apply_query", shape=(None, q.shape[2]))
    h, hkv, d = (_dim(q, 1, "q", "smooth_apply_query"), _dim(lam, 0, "lam", "smooth_apply_query"),
                 _dim(q, 2, "q", "smooth_apply_query"))
    y = q.copy()
    _check(lib.kvpq_smooth_apply_query(_ptr(y), y.shape[0], h, hkv, d, _ptr(lam)),
           "smooth_apply_query")
    return y


# ---- codebook file ----------------------------------------------------------------------------------

class Codebook:
    """A model's trained codebooks (kvpq_codebook): per layer a key and a value ProductQuantizer, the
    key smoothing factors lambda and key mean mu, plus string metadata; saved as safetensors.
    keys, values: a preset name ("d4b8", ...) or (M, nbits); granularity: "shared", "subspace", or a
    (key, value) pair of them.

    Codebook(n_layer, n_head_kv, head_dim, keys="d4b8", values=None, ...) makes an untrained one
    (lambda 1, mu 0, zero centroids); Codebook.load(path) reads a file; kvpq.calibrate() trains one."""

    def __init__(self, n_layer: int, n_head_kv: int, head_dim: int, keys: QuantizerSpec = "d4b8",
                 values: Optional[QuantizerSpec] = None, granularity: str = "shared", value_rotate: bool = False,
                 key_norm: bool = True, value_norm: bool = True, keys2: Optional[QuantizerSpec] = None,
                 _handle: Any = None) -> None:
        if _handle is not None:
            self._h = ffi.gc(_handle, lib.kvpq_codebook_free)
            return
        w = "Codebook"
        cp = ffi.new("kvpq_codebook_params *", lib.kvpq_codebook_params_default())
        cp.n_layer = _int(n_layer, "n_layer", w, 1)
        cp.n_head_kv = _int(n_head_kv, "n_head_kv", w, 1)
        cp.head_dim = _int(head_dim, "head_dim", w, 1)
        kg, vg = (granularity, granularity) if isinstance(granularity, str) else granularity
        cp.key = self._quantizer(w, head_dim, keys, kg)[0]
        cp.value = self._quantizer(w, head_dim, values if values is not None else keys, vg)[0]
        cp.value_rotate = int(bool(value_rotate))
        cp.key_norm = int(bool(key_norm))
        cp.value_norm = int(bool(value_norm))
        if keys2 is not None:  # residual second stage of the keys (same nbits and granularity as keys)
            cp.key_stages = 2
            cp.key2 = self._quantizer(w, head_dim, keys2, kg)[0]
        h = ffi.new("kvpq_codebook **")
        _check(lib.kvpq_codebook_new(h, cp), w)
        self._h = ffi.gc(h[0], lib.kvpq_codebook_free)

    @staticmethod
    def _quantizer(where, d, spec, granularity):
        if isinstance(spec, str):
            return _pq_params(where, d, granularity=granularity, preset=spec)
        if isinstance(spec, (tuple, list)) and len(spec) == 2:
            return _pq_params(where, d, M=spec[0], nbits=spec[1], granularity=granularity)
        raise _arg_error(where, f"keys/values: {spec!r}: expected a preset name or (M, nbits)")

    @classmethod
    def load(cls, path: PathLike) -> "Codebook":
        """Read and validate a codebook file (kvpq_codebook_load)."""
        h = ffi.new("kvpq_codebook **")
        _check(lib.kvpq_codebook_load(h, os.fsencode(path)), f"Codebook.load('{path}')")
        return cls(0, 0, 0, _handle=h[0])

    def save(self, path: PathLike) -> None:
        """Write atomically as safetensors (kvpq_codebook_save)."""
        _check(lib.kvpq_codebook_save(self._h, os.fsencode(path)), f"Codebook.save('{path}')")

    @property
    def params(self) -> Any:
        return lib.kvpq_codebook_get_params(self._h)

    @property
    def n_layer(self) -> int:
        return self.params.n_layer

    @property
    def n_head_kv(self) -> int:
        return self.params.n_head_kv

    @property
    def head_dim(self) -> int:
        return self.params.head_dim

    def _layer(self, layer, where):
        layer = _int(layer, "layer", where)
        if not 0 <= layer < self.n_layer:
            raise _arg_error(where, f"layer: {layer} out of range 0..{self.n_layer - 1}")
        return layer

    def key_pq(self, layer: int) -> ProductQuantizer:
        """The key ProductQuantizer of a layer (borrowed: lives as long as this codebook)."""
        return ProductQuantizer(_borrow=(lib.kvpq_codebook_pq(self._h, self._layer(layer, "Codebook.key_pq"), 0),
                                         self))

    def value_pq(self, layer: int) -> ProductQuantizer:
        """The value ProductQuantizer of a layer (borrowed)."""
        return ProductQuantizer(_borrow=(lib.kvpq_codebook_pq(self._h, self._layer(layer, "Codebook.value_pq"), 1),
                                         self))

    def key2_pq(self, layer: int) -> Optional[ProductQuantizer]:
        """The stage-two key ProductQuantizer of a layer (borrowed), or None with one key stage."""
        h = lib.kvpq_codebook_key_pq2(self._h, self._layer(layer, "Codebook.key2_pq"))
        return None if h == ffi.NULL else ProductQuantizer(_borrow=(h, self))

    def set_layer_key_stages(self, layer: int, stages: int) -> None:
        """One or two key stages for a layer of a two-stage codebook (kvpq_codebook_set_layer_key_stages)."""
        _check(lib.kvpq_codebook_set_layer_key_stages(self._h, self._layer(layer, "Codebook.set_layer_key_stages"),
                                                      _int(stages, "stages", "Codebook.set_layer_key_stages", 1)),
               "Codebook.set_layer_key_stages")

    def set_layer_key_M(self, layer: int, M: int) -> None:
        """Give one layer's key quantizer M sub-vectors (kvpq_codebook_set_layer_key_M)."""
        _check(lib.kvpq_codebook_set_layer_key_M(self._h, self._layer(layer, "Codebook.set_layer_key_M"),
                                                 _int(M, "M", "Codebook.set_layer_key_M", 1)),
               "Codebook.set_layer_key_M")

    def set_layer_value_M(self, layer: int, M: int) -> None:
        """Give one layer's value quantizer M sub-vectors (kvpq_codebook_set_layer_value_M)."""
        _check(lib.kvpq_codebook_set_layer_value_M(self._h, self._layer(layer, "Codebook.set_layer_value_M"),
                                                   _int(M, "M", "Codebook.set_layer_value_M", 1)),
               "Codebook.set_layer_value_M")

    def _rows(self, ptr):
        n = self.n_head_kv * self.head_dim
        return np.frombuffer(ffi.buffer(ptr, n * 4), np.float32).reshape(self.n_head_kv, self.head_dim)

    def key_smooth(self, layer: int) -> NDArray[np.float32]:
        """Copy of a layer's key smoothing factors lambda: (n_head_kv, head_dim) float32."""
        return self._rows(lib.kvpq_codebook_key_smooth(self._h, self._layer(layer, "Codebook.key_smooth"))).copy()

    def set_key_smooth(self, layer: int, lam: ArrayLike) -> None:
        lam = _array(lam, "lam", "Codebook.set_key_smooth", shape=(self.n_head_kv, self.head_dim))
        if not (lam > 0).all():
            raise _arg_error("Codebook.set_key_smooth", "lam: every factor must be > 0")
        self._rows(lib.kvpq_codebook_key_smooth(self._h, self._layer(layer, "Codebook.set_key_smooth")))[:] = lam

    def key_mean(self, layer: int) -> NDArray[np.float32]:
        """Copy of a layer's key mean mu: (n_head_kv, head_dim) float32."""
        return self._rows(lib.kvpq_codebook_key_mean(self._h, self._layer(layer, "Codebook.key_mean"))).copy()

    def set_key_mean(self, layer: int, mu: ArrayLike) -> None:
        mu = _array(mu, "mu", "Codebook.set_key_mean", shape=(self.n_head_kv, self.head_dim))
        self._rows(lib.kvpq_codebook_key_mean(self._h, self._layer(layer, "Codebook.set_key_mean")))[:] = mu

    def key_rope_freq(self, layer: int) -> NDArray[np.float32]:
        """Copy of a layer's RoPE frequencies inv_freq, (key_rope_dims // 2,) float32: the layer codes keys
        before RoPE where any is nonzero (kvpq_codebook_params.key_rope_dims; all 0: as given); empty
        when the codebook has no rotation (key_rope_dims 0)."""
        n = self.params.key_rope_dims // 2
        f = lib.kvpq_codebook_key_rope_freq(self._h, self._layer(layer, "Codebook.key_rope_freq"))
        if n == 0 or f == ffi.NULL:
            return np.zeros(0, np.float32)
        return np.frombuffer(ffi.buffer(f, 4 * n), np.float32).copy()

    def slice_heads(self, h0: int, n_head_kv: int) -> "Codebook":
        """A codebook for KV heads [h0, h0 + n_head_kv) (kvpq_codebook_slice_heads): the same
        quantizers, those heads' smoothing factors and key means. For a tensor-parallel rank that
        holds those heads; KVPQCache slices by itself when it sees fewer KV heads than the codebook's."""
        w = "Codebook.slice_heads"
        h = ffi.new("kvpq_codebook **")
        _check(lib.kvpq_codebook_slice_heads(h, self._h, _int(h0, "h0", w, 0), _int(n_head_kv, "n_head_kv", w, 1)), w)
        return Codebook(0, 0, 0, _handle=h[0])

    def meta(self) -> Dict[str, str]:
        """Every metadata entry (config keys included) as a dict of strings."""
        out = {}
        for i in range(int(lib.kvpq_codebook_meta_count(self._h))):
            k = _str(lib.kvpq_codebook_meta_key(self._h, i))
            out[k] = _str(lib.kvpq_codebook_get_meta(self._h, k.encode()))
        return out

    def get_meta(self, key: str) -> Optional[str]:
        return _str(lib.kvpq_codebook_get_meta(self._h, key.encode()))

    def set_meta(self, key: str, value: str) -> None:
        """Set metadata key to value (str; saved with the codebook). A NUL character in either is
        refused (kvpq.Error): the C string would end there and store another key."""
        key, value = str(key), str(value)
        for name, text in (("key", key), ("value", value)):
            if "\0" in text:
                raise _arg_error("Codebook.set_meta", f"{name}: holds a NUL character at index {text.index(chr(0))}")
        _check(lib.kvpq_codebook_set_meta(self._h, key.encode(), value.encode()), "Codebook.set_meta")

    def info(self) -> Dict[str, Any]:
        """A summary dict: n_layer, n_head_kv, head_dim, key/value (d, M, nbits, granularity),
        value_rotate, key_norm, value_norm, key_M and value_M per layer, bits per element of the codes,
        meta."""
        p = self.params

        def q(pp):
            return {"d": pp.d, "M": pp.M, "nbits": pp.nbits, "granularity": _GRAN_NAME[pp.granularity]}
        key_M = [int(lib.kvpq_codebook_layer_key_M(self._h, i)) for i in range(p.n_layer)]
        bits_k = sum(m * p.key.nbits for m in key_M) / (p.n_layer * p.head_dim)
        value_M = [int(lib.kvpq_codebook_layer_value_M(self._h, i)) for i in range(p.n_layer)]
        stages = [int(lib.kvpq_codebook_layer_key_stages(self._h, i)) for i in range(p.n_layer)]
        bits_v = sum(m * p.value.nbits for m in value_M) / (p.n_layer * p.head_dim)
        return {"n_layer": p.n_layer, "n_head_kv": p.n_head_kv, "head_dim": p.head_dim, "key": q(p.key),
                "value": q(p.value), "value_rotate": bool(p.value_rotate), "key_norm": bool(p.key_norm),
                "value_norm": bool(p.value_norm), "key_M": key_M, "value_M": value_M,
                "key_stages": p.key_stages, "key2": q(p.key2) if p.key_stages == 2 else None,
                "key_stages_per_layer": stages,
                "bits_per_element": {"key": bits_k + sum(s == 2 for s in stages) * p.key2.M * p.key2.nbits
                                     / (p.n_layer * p.head_dim), "value": bits_v},
                "key_rope": ({"dims": p.key_rope_dims, "layout": "neox" if p.key_rope_neox else "norm"}
                             if p.key_rope_dims else None),
                "meta": self.meta()}

    def __repr__(self):
        p = self.params
        return (f"Codebook(n_layer={p.n_layer}, n_head_kv={p.n_head_kv}, head_dim={p.head_dim}, "
                f"key M={p.key.M} nbits={p.key.nbits}, value M={p.value.M} nbits={p.value.nbits})")


def calibrate_layer(codebook: Codebook, layer: int, k: ArrayLike, v: ArrayLike, center: bool = True,
                    smooth_floor: float = 1e-2, niter: Optional[int] = None, seed: Optional[int] = None,
                    max_points_per_centroid: Optional[int] = None, init: Optional[str] = None,
                    n_threads: Optional[int] = None, query_absmax: Optional[ArrayLike] = None,
                    positions: Optional[ArrayLike] = None) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Train one layer of `codebook` from its keys and values (kvpq_codebook_calibrate_layer: key
    mean, smoothing, Hadamard, normalization, k-means; the recipe of `kvpq calibrate`).
    k, v: (n_tokens, n_head_kv, head_dim) float32, keys post-RoPE. query_absmax: None (smoothing
    from the keys alone, lambda^2 = max|k|) or (n_head_kv, head_dim) float32, the largest |q| per
    KV head's query group and channel (Model.eval's query_absmax), for query-aware smoothing
    lambda^2 ~ max|k| / max|q| (kvpq_smooth_compute_qk; `kvpq calibrate`'s default).
    positions: (n_tokens,) int, each token's position in its sequence: needed when the layer codes keys
    before RoPE (Codebook.key_rope_freq not all 0), which turns each key back by -position first.
    Returns (key report, value report)."""
    w = "calibrate_layer"
    shape = (None, codebook.n_head_kv, codebook.head_dim)
    k = _array(k, "k", w, shape=shape)
    v = _array(v, "v", w, shape=shape)
    if k.shape != v.shape:
        raise _arg_error(w, f"v: shape {v.shape} differs from k's {k.shape}")
    cp = ffi.new("kvpq_calibrate_params *", lib.kvpq_calibrate_params_default())
    cp.center = int(bool(center))
    cp.smooth_floor = float(smooth_floor)
    cp.kmeans = _kmeans_params(w, niter, seed, max_points_per_centroid, init, n_threads, base=cp.kmeans)[0]
    qa = None
    if query_absmax is not None:
        qa = _array(query_absmax, "query_absmax", w, shape=(codebook.n_head_kv, codebook.head_dim))
        qa = np.ascontiguousarray(qa, dtype=np.float32)
        cp.query_absmax = _ptr(qa)
    pos = None
    if positions is not None:
        pos = np.ascontiguousarray(positions, dtype=np.int64)
        if pos.shape != (k.shape[0],) or (pos < 0).any() or (pos >= 2**31).any():
            raise _arg_error(w, f"positions: expected ({k.shape[0]},) integers in [0, 2^31), got shape {pos.shape}")
        pos = pos.astype(np.int32)
        cp.positions = ffi.cast("int32_t *", pos.ctypes.data)
    rk, rv = ffi.new("kvpq_kmeans_report *"), ffi.new("kvpq_kmeans_report *")
    _check(lib.kvpq_codebook_calibrate_layer(codebook._h, codebook._layer(layer, w), k.shape[0], _ptr(k), _ptr(v),
                                             cp, rk, rv), w)
    return _report(rk), _report(rv)


def calibrate(source: Any, *args: Any, **kw: Any) -> Any:
    """Train a Codebook. Two forms:

    calibrate(model, text, bits=None, **options): a kvpq.Model run over a text by the library's
      calibration driver, the call `kvpq calibrate` makes (same options, same defaults, the same file
      bytes); bits: a budget in effective bits per element (a per-layer allocation with its window and
      sinks recorded in the codebook), a sequence of budgets, or None. See kvpq._calibrate.calibrate_model.
    calibrate(keys_values, keys="d4b8", ...): from keys and values you collected (calibrate_activations).
    """
    if isinstance(source, Model):
        from ._calibrate import calibrate_model
        return calibrate_model(source, *args, **kw)
    return calibrate_activations(source, *args, **kw)


def calibrate_activations(keys_values: Any, keys: QuantizerSpec = "d4b8", values: Optional[QuantizerSpec] = None,
                          granularity: str = "shared", keys2: Optional[QuantizerSpec] = None, value_rotate: bool = False,
                          key_norm: bool = True, value_norm: bool = True, keys_layers: Optional[Mapping[int, str]] = None,
                          values_layers: Optional[Mapping[int, str]] = None, center: bool = True, niter: Optional[int] = None,
                          seed: Optional[int] = None, max_points_per_centroid: Optional[int] = None, init: Optional[str] = None,
                          n_threads: Optional[int] = None, meta: Optional[Mapping[str, str]] = None,
                          query_absmax: Optional[ArrayLike] = None, norm_bits: int = 16) -> Codebook:
    """Train a Codebook from keys and values a model produced.

    keys_values: a sequence over layers of (k, v) pairs, each (n_tokens, n_head_kv, head_dim)
      float32 post-RoPE (an iterator is fine: one layer is held at a time), or a pair of arrays
      (K, V) of shape (n_layer, n_tokens, n_head_kv, head_dim).
    keys, values: presets ("d8b8" 1 bit/element, "d8b12", "d4b8" 2, "d4b12" 3, "d2b8" 4, "d1b8" 8;
      values default to keys).
    granularity: "shared", "subspace" or "head" (one codebook per KV head), or a (key, value) pair.
    keys2: preset of a residual second key stage (same nbits), e.g. "d8b8"; None: one stage.
    keys_layers: {layer: preset} giving some layers' keys another M (same nbits).
    values_layers: likewise for values.
    query_absmax: None (smoothing from the keys alone, as VecInfer) or (n_layer, n_head_kv, head_dim)
      float32 from Model.eval(..., query_absmax=...) over the same text: query-aware smoothing, as
      `kvpq calibrate` does by default (its --smooth-query 1).
    norm_bits: 16 (float16) or 8: bits of each norm-explicit scale the VQ cache keeps (metadata
      k.norm_bits / v.norm_bits; 8 = a log-coded byte in 1/16-octave steps, relative error <= 2.2%,
      for the layers whose quantizer has at most 4 bits per element; `kvpq calibrate --norm-bits`).
    The rest as `kvpq calibrate` (same defaults: center, norm-explicit keys and values, k-means 25
    iterations, random init, seed 1234), so the same activations (and query_absmax) give the same
    file bytes.
    meta: extra string metadata. Returns the Codebook."""
    if isinstance(keys_values, tuple) and len(keys_values) == 2 and isinstance(keys_values[0], np.ndarray) \
            and keys_values[0].ndim == 4:
        K, V = keys_values
        K = _array(K, "K", "calibrate", shape=(None, None, None, None))
        V = _array(V, "V", "calibrate", shape=K.shape)
        pairs = [(K[i], V[i]) for i in range(K.shape[0])]
    else:
        pairs = keys_values
    if not hasattr(pairs, "__iter__"):
        raise _arg_error("calibrate", f"keys_values: expected a sequence of (k, v) pairs, got {type(pairs).__name__}")
    if norm_bits not in (8, 16) or isinstance(norm_bits, bool):
        raise _arg_error("calibrate", f"norm_bits: expected 8 or 16, got {norm_bits!r}")
    cb = None
    n_tok = 0
    for layer, kv in enumerate(pairs):
        if not (isinstance(kv, (tuple, list)) and len(kv) == 2):
            raise _arg_error("calibrate", f"keys_values: layer {layer}: expected a (k, v) pair of arrays, got "
                                          f"{type(kv).__name__}")
        k, v = kv
        k = _array(k, f"k (layer {layer})", "calibrate", shape=(None, None, None))
        if cb is None:
            n_layer = len(pairs) if hasattr(pairs, "__len__") else None
            if n_layer is None:
                raise _arg_error("calibrate", "keys_values: needs a length (a list or tuple over layers)")
            if query_absmax is not None:  # one (n_head_kv, head_dim) row per layer, checked before any training
                query_absmax = _array(query_absmax, "query_absmax", "calibrate",
                                      shape=(n_layer, k.shape[1], k.shape[2]))
            try:
                cb = Codebook(n_layer, k.shape[1], k.shape[2], keys=keys, values=values, granularity=granularity,
                              keys2=keys2, value_rotate=value_rotate, key_norm=key_norm, value_norm=value_norm)
            except ArgumentError as e:  # the shape comes from k: say so
                raise _arg_error("calibrate", f"k (layer {layer}): shape {tuple(k.shape)}: {e.detail}") from None
            for l, preset in (keys_layers or {}).items():
                q = _pq_params("calibrate", k.shape[2], preset=preset)
                cb.set_layer_key_M(l, q.M)
            for l, preset in (values_layers or {}).items():
                cb.set_layer_value_M(l, _pq_params("calibrate", k.shape[2], preset=preset).M)
        n_tok = k.shape[0]
        calibrate_layer(cb, layer, k, v, center=center, niter=niter, seed=seed,
                        max_points_per_centroid=max_points_per_centroid, init=init, n_threads=n_threads,
                        query_absmax=None if query_absmax is None else query_absmax[layer])
    if cb is None:
        raise _arg_error("calibrate", "keys_values: no layers")
    if norm_bits == 8:
        if key_norm:
            cb.set_meta("k.norm_bits", "8")
        if value_norm:
            cb.set_meta("v.norm_bits", "8")
    cb.set_meta("tokens", n_tok)
    cb.set_meta("keys", keys)
    cb.set_meta("values", values or keys)
    cb.set_meta("key_smooth", "keys" if query_absmax is None else "query")
    for k, v in (meta or {}).items():
        cb.set_meta(k, v)
    return cb


# ---- KV cache ----------------------------------------------------------------------------------------

_CACHE_KINDS = {"fp32": lib.KVPQ_CACHE_FP32, "fp16": lib.KVPQ_CACHE_FP16, "q8_0": lib.KVPQ_CACHE_Q8_0,
                "q4_0": lib.KVPQ_CACHE_Q4_0, "kivi2": lib.KVPQ_CACHE_KIVI2, "kivi4": lib.KVPQ_CACHE_KIVI4,
                "vq": lib.KVPQ_CACHE_VQ, "q8_0r": lib.KVPQ_CACHE_Q8_0R, "q4_0r": lib.KVPQ_CACHE_Q4_0R}


def cache_settings(kind: str, codebook: Optional[Codebook] = None, window: Optional[int] = None,
                   sinks: Optional[int] = None) -> Tuple[int, int]:
    """(window, sinks) of a cache of `kind` made as the CLI makes it (kvpq_cache_params_resolve):
    window / sinks when given; else, for "vq", what the codebook's allocation was made for (its
    alloc.window / alloc.sinks metadata, from `kvpq calibrate --bits`); else the defaults: window
    128, sinks 1 for vq, kivi2, kivi4 and q4_0r and 0 for the other kinds (kvpq_cache_default_sinks).
    Model.new_cache and kvpq.transformers.KVPQCache use it; Cache(...) itself takes its arguments as
    given (window 128, sinks 0 by default, as kvpq_cache_new). Errors (kvpq.Error): an unknown kind,
    metadata that is not a number in range (named)."""
    w = "cache_settings"
    if kind not in _CACHE_KINDS:
        raise _arg_error(w, f"kind: '{kind}' is not one of {sorted(_CACHE_KINDS)}")
    p = ffi.new("kvpq_cache_params *", lib.kvpq_cache_params_default())
    p.type = _CACHE_KINDS[kind]
    if codebook is not None:
        if not isinstance(codebook, Codebook):
            raise _arg_error(w, f"codebook: expected a kvpq.Codebook, got {type(codebook).__name__}")
        p.codebook = codebook._h
    win = -1 if window is None else _int(window, "window", w, 0)
    sk = -1 if sinks is None else _int(sinks, "sinks", w, 0)
    _check(lib.kvpq_cache_params_resolve(p, win, sk), w)
    return int(p.window), int(p.sinks)


ERR_BUDGET = lib.KVPQ_ERR_BUDGET


class PagePool:
    """One byte budget over the pages of many caches (kvpq_page_pool, docs/cache.md "Page pool"):
    pass it as Cache(..., pool=...) (or Model.new_cache(..., pool=...)). budget: bytes, 0 = unbounded.
    Pages given back by a truncate or a freed cache are kept and handed out again (free lists keyed by
    size). A page beyond the budget fails the append, reserve or load with kvpq.Error of status
    ERR_BUDGET (kvpq.ERR_BUDGET) and changes nothing. Thread-safe (a mutex in the pool); the pool
    lives while a cache made with it does."""

    def __init__(self, budget: int = 0) -> None:
        h = ffi.new("kvpq_page_pool **")
        _check(lib.kvpq_page_pool_new(h, _int(budget, "budget", "PagePool", 0, 2**63 - 1)), "PagePool")
        self._h = ffi.gc(h[0], lib.kvpq_page_pool_free)

    @property
    def budget(self) -> int:
        return self.stats()["budget_bytes"]

    @budget.setter
    def budget(self, budget: int) -> None:
        _check(lib.kvpq_page_pool_set_budget(self._h, _int(budget, "budget", "PagePool.budget", 0, 2**63 - 1)),
               "PagePool.budget")

    def trim(self) -> None:
        """Release the free pages to the system."""
        lib.kvpq_page_pool_trim(self._h)

    def stats(self) -> Dict[str, int]:
        """budget_bytes, bytes_in_use, bytes_free, pages_in_use, pages_free, allocs, reused, refused,
        caches (kvpq_page_pool_stats)."""
        st = ffi.new("kvpq_page_pool_stats *")
        _check(lib.kvpq_page_pool_get_stats(self._h, st), "PagePool.stats")
        return {f: int(getattr(st, f)) for f in ("budget_bytes", "bytes_in_use", "bytes_free", "pages_in_use",
                                                 "pages_free", "allocs", "reused", "refused", "caches")}

    def __repr__(self):
        st = self.stats()
        return (f"PagePool(budget={st['budget_bytes']}, in_use={st['bytes_in_use']}, free={st['bytes_free']}, "
                f"caches={st['caches']})")


class Cache:
    """A KV cache of n_layer layers (kvpq_cache). kind: "fp32", "fp16", "q8_0", "q4_0", "q8_0r",
    "q4_0r" (llama.cpp's Hadamard-rotated q8_0 / q4_0), "kivi2", "kivi4", or "vq" (product-quantization
    codes, attention from codes through per-query lookup tables; needs `codebook`). window: newest
    positions kept in float32 (vq/kivi). sinks: the first positions kept in fp16 beside a quantized
    kind (attention sinks, kvpq_cache_params.sinks; 0 = none). pool: a PagePool whose pages and budget
    the cache shares with others (None: its own). The codebook is kept alive by the cache."""

    def __init__(self, kind: str, n_layer: int, n_head: int, n_head_kv: int, head_dim: int, max_seq: int,
                 codebook: Optional[Codebook] = None, window: Optional[int] = None, page_tokens: Optional[int] = None,
                 n_threads: int = 0, fast_scan: bool = False, sliding_window: int = 0,
                 swa_layers: Optional[Sequence[bool]] = None, sinks: int = 0,
                 pool: Optional[PagePool] = None) -> None:
        w = "Cache"
        if kind not in _CACHE_KINDS:
            raise _arg_error(w, f"kind: '{kind}' is not one of {sorted(_CACHE_KINDS)}")
        if kind == "vq" and not isinstance(codebook, Codebook):
            raise _arg_error(w, "codebook: a vq cache needs a kvpq.Codebook")
        if pool is not None and not isinstance(pool, PagePool):
            raise _arg_error(w, "pool: expected a kvpq.PagePool or None")
        p = ffi.new("kvpq_cache_params *", lib.kvpq_cache_params_default())
        p.type = _CACHE_KINDS[kind]
        p.n_layer = _int(n_layer, "n_layer", w, 1)
        p.n_head = _int(n_head, "n_head", w, 1)
        p.n_head_kv = _int(n_head_kv, "n_head_kv", w, 1)
        p.head_dim = _int(head_dim, "head_dim", w, 1)
        p.max_seq = _int(max_seq, "max_seq", w, 1)
        if window is not None:
            p.window = _int(window, "window", w, 0)
        if page_tokens is not None:
            p.page_tokens = _int(page_tokens, "page_tokens", w, 1)
        p.n_threads = _int(n_threads, "n_threads", w, 0)
        p.vq_fast_scan = int(bool(fast_scan))
        # sliding_window: local layers see only the newest sliding_window positions (kvpq.h);
        # swa_layers: (n_layer) flags of the local layers, None = every layer. Copied by kvpq_cache_new.
        p.sliding_window = _int(sliding_window, "sliding_window", w, 0)
        swa = None
        if swa_layers is not None:
            flags = [1 if f else 0 for f in swa_layers]
            if len(flags) != p.n_layer:
                raise _arg_error(w, f"swa_layers: {len(flags)} flags for {p.n_layer} layers")
            swa = ffi.new("uint8_t[]", flags)
            p.swa_layers = swa
        p.sinks = _int(sinks, "sinks", w, 0)
        self._codebook = codebook
        if codebook is not None:
            p.codebook = codebook._h
        self.pool = pool
        if pool is not None:
            p.pool = pool._h
        h = ffi.new("kvpq_cache **")
        _check(lib.kvpq_cache_new(h, p), w)
        self._h = ffi.gc(h[0], lib.kvpq_cache_free)
        self.kind, self.n_layer, self.n_head, self.n_head_kv, self.head_dim, self.max_seq = (
            kind, p.n_layer, p.n_head, p.n_head_kv, p.head_dim, p.max_seq)
        self.window = p.window
        self.sliding_window = p.sliding_window
        self.swa_layers = (None if p.sliding_window == 0 else
                           [True] * p.n_layer if swa is None else [bool(x) for x in swa])

    def _layer(self, layer, where):
        layer = _int(layer, "layer", where)
        if not 0 <= layer < self.n_layer:
            raise _arg_error(where, f"layer: {layer} out of range 0..{self.n_layer - 1}")
        return layer

    def append(self, layer: int, k: ArrayLike, v: ArrayLike) -> None:
        """Append positions to a layer: k, v (n, n_head_kv, head_dim) float32, keys post-RoPE."""
        w = "Cache.append"
        shape = (None, self.n_head_kv, self.head_dim)
        k = _array(k, "k", w, shape=shape)
        v = _array(v, "v", w, shape=shape)
        if k.shape[0] != v.shape[0]:
            raise _arg_error(w, f"v: {v.shape[0]} positions, k has {k.shape[0]}")
        _check(lib.kvpq_cache_append(self._h, self._layer(layer, w), k.shape[0], _ptr(k), _ptr(v)), w)

    def attend(self, layer: int, q: ArrayLike) -> NDArray[np.float32]:
        """Causal attention of the newest n_q positions: q (n_q, n_head, head_dim) float32 -> out of
        the same shape; query i (position L - n_q + i) attends to positions 0 .. L - n_q + i with
        scale 1/sqrt(head_dim), query head h reading KV head h // (n_head // n_head_kv)."""
        w = "Cache.attend"
        q = _array(q, "q", w, shape=(None, self.n_head, self.head_dim))
        out = np.empty_like(q)
        _check(lib.kvpq_cache_attend(self._h, self._layer(layer, w), q.shape[0], _ptr(q), _ptr(out)), w)
        return out

    def append_attend(self, layer: int, k: ArrayLike, v: ArrayLike, q: ArrayLike) -> NDArray[np.float32]:
        """Append n positions and attend their n queries, each query seeing the cache as it was right
        after its own position was appended (kvpq_cache_append_attend): the same outputs whatever
        split the positions come in. k, v (n, n_head_kv, head_dim), q (n, n_head, head_dim) float32
        -> out (n, n_head, head_dim)."""
        w = "Cache.append_attend"
        shape = (None, self.n_head_kv, self.head_dim)
        k = _array(k, "k", w, shape=shape)
        v = _array(v, "v", w, shape=shape)
        q = _array(q, "q", w, shape=(None, self.n_head, self.head_dim))
        if not k.shape[0] == v.shape[0] == q.shape[0]:
            raise _arg_error(w, f"k, v, q: {k.shape[0]}, {v.shape[0]}, {q.shape[0]} positions; expected the same")
        out = np.empty_like(q)
        _check(lib.kvpq_cache_append_attend(self._h, self._layer(layer, w), k.shape[0], _ptr(k), _ptr(v), _ptr(q),
                                            _ptr(out)), w)
        return out

    def exact_prefix(self, n_pos: int) -> int:
        """The longest prefix of at most n_pos positions that truncate() keeps exactly as a fresh
        cache fed those positions would hold it (kvpq_cache_exact_prefix)."""
        return int(lib.kvpq_cache_exact_prefix(self._h, _int(n_pos, "n_pos", "Cache.exact_prefix", 0)))

    def reserve(self, n_pos: int) -> None:
        """Allocate now what holding n_pos positions in every layer needs (kvpq_cache_reserve), so that
        appends up to there take nothing more from the pool; raises kvpq.Error (status ERR_BUDGET)
        when the pool refuses, the cache unchanged."""
        _check(lib.kvpq_cache_reserve(self._h, _int(n_pos, "n_pos", "Cache.reserve", 0)), "Cache.reserve")

    def truncate(self, n_pos: int) -> None:
        """Keep positions [0, n_pos) of every layer."""
        _check(lib.kvpq_cache_truncate(self._h, _int(n_pos, "n_pos", "Cache.truncate", 0)), "Cache.truncate")

    def seq_len(self, layer: int = 0) -> int:
        return int(lib.kvpq_cache_seq_len(self._h, self._layer(layer, "Cache.seq_len")))

    def read(self, layer: int, pos0: int = 0, n: Optional[int] = None
             ) -> Tuple[NDArray[np.float32], NDArray[np.float32]]:
        """Positions [pos0, pos0 + n) of a layer as attention sees them (dequantized): (k, v), each
        (n, n_head_kv, head_dim) float32. n defaults to the rest of the layer."""
        w = "Cache.read"
        layer = self._layer(layer, w)
        pos0 = _int(pos0, "pos0", w, 0)
        L = self.seq_len(layer)
        n = L - pos0 if n is None else _int(n, "n", w, 0)
        if n < 0 or pos0 + n > L:  # before allocating: n may be up to 2**31 - 1
            raise _arg_error(w, f"pos0, n: positions [{pos0}, {pos0 + n}) beyond the {L} layer {layer} holds")
        k = np.empty((n, self.n_head_kv, self.head_dim), np.float32)
        v = np.empty_like(k)
        _check(lib.kvpq_cache_read(self._h, layer, pos0, n, _ptr(k), _ptr(v)), w)
        return k, v

    @property
    def resident_bytes(self) -> int:
        """Bytes resident for the stored K and V (codes, window, scales, pages, codebooks)."""
        return int(lib.kvpq_cache_resident_bytes(self._h))

    def stats(self) -> Dict[str, Any]:
        st = ffi.new("kvpq_cache_stats *")
        _check(lib.kvpq_cache_get_stats(self._h, st), "Cache.stats")
        return {"resident_bytes": int(st.resident_bytes), "elements": int(st.elements),
                "bits_per_element": st.bits_per_element, "tokens_coded": int(st.tokens_coded),
                "tokens_window": int(st.tokens_window), "stored_bytes": int(st.stored_bytes),
                "stored_bits_per_element": st.stored_bits_per_element}


# ---- CUDA cache (device pointers) -------------------------------------------------------------------

def cuda_available() -> Tuple[bool, str]:
    """(available, why): whether libkvpq was built with CUDA and a device is usable (kvpq_cuda_available)."""
    why = ffi.new("char[]", 256)
    ok = bool(lib.kvpq_cuda_available(why, 256))
    return ok, ffi.string(why).decode("utf-8", "replace")


class CudaCache:
    """One layer of a device-resident VQ cache for a batch of sequences (kvpq_cuda_cache, include/kvpq.h,
    docs/CUDA.md), made from layer `layer` of a Codebook: its key/value quantizers (norm-explicit ones
    included), key smoothing factors, key mean and, where the layer codes keys before RoPE
    (Codebook.key_rope_freq), its RoPE frequencies: the key at position t of a sequence is turned
    back by -t before coding and forward again when decoded. Lives on the CUDA device current at
    construction.
    Arguments are torch tensors on that device, float32, C-contiguous, of the shapes below (anything
    else raises kvpq.ArgumentError naming the argument):
      append(seq, k, v): k, v (n, n_head_kv, head_dim), post-RoPE keys, for sequence seq (synchronous:
        on the legacy default stream, after torch's current stream has finished its work);
      attend(q, out=None): decode attention of one query per sequence 0..n_seq-1, q (n_seq, n_head,
        head_dim), scale 1/sqrt(head_dim); enqueued on torch's current stream; returns out;
      read(seq, pos0, n, from_codes=False): (k, v) (n, n_head_kv, head_dim) of positions
        [pos0, pos0 + n) as held (the float32 window, or with from_codes every position decoded from
        its codes), keys with the key mean added back; enqueued on torch's current stream.
    Errors raise kvpq.Error (KVPQ_ERR_NO_DEVICE without a CUDA build or device)."""

    def __init__(self, codebook: Codebook, layer: int, n_head: int, n_seq: int, max_seq: int,
                 window: Optional[int] = None, page_tokens: Optional[int] = None, n_pages: int = 0) -> None:
        w = "CudaCache"
        try:
            import torch
        except ImportError as e:
            raise _arg_error(w, "needs PyTorch (its CUDA tensors are the cache's inputs and outputs)",
                             lib.KVPQ_ERR_UNSUPPORTED) from e
        if not isinstance(codebook, Codebook):
            raise _arg_error(w, "codebook: expected a kvpq.Codebook")
        layer = codebook._layer(layer, w)
        cbp = codebook.params
        p = ffi.new("kvpq_cuda_cache_params *", lib.kvpq_cuda_cache_params_default())
        p.n_head = _int(n_head, "n_head", w, 1)
        p.n_head_kv = cbp.n_head_kv
        p.head_dim = cbp.head_dim
        p.n_seq = _int(n_seq, "n_seq", w, 1)
        p.max_seq = _int(max_seq, "max_seq", w, 1)
        if window is not None:
            p.window = _int(window, "window", w, 0)
        if page_tokens is not None:
            p.page_tokens = _int(page_tokens, "page_tokens", w, 1)
        p.n_pages = _int(n_pages, "n_pages", w, 0)
        p.key = lib.kvpq_codebook_pq(codebook._h, layer, 0)
        p.value = lib.kvpq_codebook_pq(codebook._h, layer, 1)
        p.key_smooth = lib.kvpq_codebook_key_smooth(codebook._h, layer)
        p.key_mean = lib.kvpq_codebook_key_mean(codebook._h, layer)
        p.value_rotate = cbp.value_rotate
        if cbp.key_rope_dims:  # keys coded before RoPE: position t of the cache turns by t
            p.key_rope_dims = cbp.key_rope_dims
            p.key_rope_neox = cbp.key_rope_neox
            p.key_rope_freq = lib.kvpq_codebook_key_rope_freq(codebook._h, layer)
        h = ffi.new("kvpq_cuda_cache **")
        _check(lib.kvpq_cuda_cache_new(h, p), w)
        self._h = ffi.gc(h[0], lib.kvpq_cuda_cache_free)
        self._codebook = codebook
        self.n_head, self.n_head_kv, self.head_dim, self.n_seq, self.max_seq, self.window = (
            p.n_head, p.n_head_kv, p.head_dim, p.n_seq, p.max_seq, p.window)
        self.device = torch.cuda.current_device()

    def _tensor(self, t: Any, name: str, shape: Tuple[Optional[int], ...], where: str) -> Any:
        """t's device address once it is a float32 C-contiguous CUDA tensor of `shape` (None: any
        size) on this cache's device."""
        import torch
        if not isinstance(t, torch.Tensor):
            raise _arg_error(where, f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
            dims = ", ".join("N" if x is None else str(x) for x in shape)
            raise _arg_error(where, f"{name}: shape {tuple(t.shape)}, expected ({dims})")
        if not t.is_cuda or t.device.index != self.device:
            raise _arg_error(where, f"{name}: on {t.device}, the cache is on cuda:{self.device}")
        if t.dtype != torch.float32:
            raise _arg_error(where, f"{name}: dtype {t.dtype}, expected torch.float32")
        if not t.is_contiguous():
            raise _arg_error(where, f"{name}: not contiguous")
        return ffi.cast("float *", t.data_ptr())

    def _stream(self) -> Any:
        import torch
        return ffi.cast("void *", torch.cuda.current_stream(self.device).cuda_stream)

    def _seq(self, seq: int, where: str) -> int:
        return _int(seq, "seq", where, 0, self.n_seq - 1)

    def append(self, seq: int, k: Any, v: Any) -> None:
        import torch
        w = "CudaCache.append"
        seq = self._seq(seq, w)
        kp = self._tensor(k, "k", (None, self.n_head_kv, self.head_dim), w)
        vp = self._tensor(v, "v", tuple(k.shape), w)
        with torch.cuda.device(self.device):
            # kvpq_cuda_cache_append runs on the legacy default stream and returns when done; work
            # queued on another torch stream (k, v made there, a read of the ring) must finish first
            stream = torch.cuda.current_stream(self.device)
            if stream.cuda_stream != 0:
                stream.synchronize()
            _check(lib.kvpq_cuda_cache_append(self._h, seq, int(k.shape[0]), kp, vp), w)

    def attend(self, q: Any, out: Any = None) -> Any:
        import torch
        w = "CudaCache.attend"
        qp = self._tensor(q, "q", (None, self.n_head, self.head_dim), w)
        shape = tuple(q.shape)
        n_seq = shape[0]
        if out is None:
            out = torch.empty(shape, dtype=torch.float32, device=q.device)
        op = self._tensor(out, "out", shape, w)
        with torch.cuda.device(self.device):
            _check(lib.kvpq_cuda_cache_attend_async(self._h, n_seq, qp, op, self._stream()), w)
        return out

    def read(self, seq: int, pos0: int, n: int, from_codes: bool = False) -> Tuple[Any, Any]:
        import torch
        w = "CudaCache.read"
        seq = self._seq(seq, w)
        shape = (_int(n, "n", w, 0), self.n_head_kv, self.head_dim)
        k = torch.empty(shape, dtype=torch.float32, device=f"cuda:{self.device}")
        v = torch.empty_like(k)
        kp, vp = self._tensor(k, "k", shape, w), self._tensor(v, "v", shape, w)
        with torch.cuda.device(self.device):
            _check(lib.kvpq_cuda_cache_read(self._h, seq, _int(pos0, "pos0", w, 0), shape[0], int(bool(from_codes)),
                                            kp, vp, self._stream()), w)
        return k, v

    def seq_len(self, seq: int = 0) -> int:
        return int(lib.kvpq_cuda_cache_seq_len(self._h, int(seq)))

    def clear(self, seq: int) -> None:
        _check(lib.kvpq_cuda_cache_clear(self._h, int(seq)), "CudaCache.clear")

    @property
    def resident_bytes(self) -> int:
        """Device bytes held (code pages in use, window, codebooks, page tables; kvpq.h)."""
        return int(lib.kvpq_cuda_cache_resident_bytes(self._h))


# ---- models (GGUF) -----------------------------------------------------------------------------------

class Model:
    """A GGUF model run by kvpq's own forward pass (kvpq_model: the architectures llama, qwen2 and gemma3)."""

    def __init__(self, path: PathLike, n_threads: int = 0) -> None:
        mp = ffi.new("kvpq_model_params *", lib.kvpq_model_params_default())
        mp.n_threads = _int(n_threads, "n_threads", "Model", 0)
        h = ffi.new("kvpq_model **")
        _check(lib.kvpq_model_load(h, os.fsencode(path), mp), f"Model('{path}')")
        self.path = os.fspath(path)
        self._h = ffi.gc(h[0], lib.kvpq_model_free)
        mi = ffi.new("kvpq_model_info *")
        _check(lib.kvpq_model_get_info(self._h, mi), "Model")
        self.info = {f: getattr(mi, f) for f in ("n_layer", "n_head", "n_head_kv", "head_dim", "n_embd", "n_ff",
                                                 "n_vocab", "n_ctx_train", "rope_freq_base", "rms_eps", "bos_id",
                                                 "eos_id", "add_bos")}
        self.info["arch"] = ffi.string(mi.arch).decode()
        self.info["name"] = ffi.string(mi.name).decode()

    def tokenize(self, text: Union[str, bytes], add_bos: bool = False, parse_special: bool = False
                 ) -> NDArray[np.int32]:
        """UTF-8 text -> token ids (n,) int32."""
        b = _text(text, self.__class__.__name__ + ".tokenize")
        n = ffi.new("size_t *")
        _check(lib.kvpq_tokenize(self._h, b, len(b), int(add_bos), int(parse_special), ffi.NULL, 0, n), "Model.tokenize")
        out = np.empty(n[0], np.int32)
        _check(lib.kvpq_tokenize(self._h, b, len(b), int(add_bos), int(parse_special), _ptr(out, "int32_t *"), n[0], n),
               "Model.tokenize")
        return out

    def token_to_piece(self, token: int) -> bytes:
        n = ffi.new("size_t *")
        buf = ffi.new("char[]", 256)
        token = _int(token, "token", "Model.token_to_piece")
        _check(lib.kvpq_token_to_piece(self._h, token, buf, 256, n), "Model.token_to_piece")
        if n[0] > 256:
            buf = ffi.new("char[]", n[0])
            _check(lib.kvpq_token_to_piece(self._h, token, buf, n[0], n), "Model.token_to_piece")
        return ffi.buffer(buf, n[0])[:]

    def new_cache(self, kind: str = "fp32", max_seq: Optional[int] = None, codebook: Optional[Codebook] = None,
                  window: Optional[int] = None, sinks: Optional[int] = None, **kw: Any) -> Cache:
        """A Cache shaped for this model, with its sliding-window layers (kvpq_model_cache_params), its
        window and sinks as the CLI's `--cache` makes them (cache_settings: given, else the codebook's
        alloc.window / alloc.sinks, else the kind's defaults), so the same codebook gives the same cache.
        kind: a kind name, or any CLI cache SPEC (kvpq_cache_spec_parse: "vq:cb.safetensors:w64",
        "kivi2:s0", "tq3"); a SPEC's suffixes count as window= / sinks= (an argument given too must agree).
        (`:cuda` SPECs are refused here: the Python CUDA path is KVPQCache / CudaCache.)"""
        i = self.info
        if kind not in _CACHE_KINDS:
            kind, codebook, window, sinks = self._from_spec(kind, codebook, window, sinks)
        kw["window"], kw["sinks"] = cache_settings(kind, codebook, window, sinks)
        cp = ffi.new("kvpq_cache_params *", lib.kvpq_cache_params_default())
        _check(lib.kvpq_model_cache_params(self._h, cp), "Model.new_cache")
        if cp.sliding_window > 0 and "sliding_window" not in kw:
            kw["sliding_window"] = cp.sliding_window
            if cp.swa_layers != ffi.NULL and "swa_layers" not in kw:
                kw["swa_layers"] = [cp.swa_layers[l] for l in range(i["n_layer"])]
        return Cache(kind, i["n_layer"], i["n_head"], i["n_head_kv"], i["head_dim"], max_seq or i["n_ctx_train"],
                     codebook=codebook, **kw)

    def _from_spec(self, spec: str, codebook: Optional[Codebook], window: Optional[int],
                   sinks: Optional[int]) -> Tuple[str, Optional[Codebook], Optional[int], Optional[int]]:
        """(kind, codebook, window, sinks) of a cache SPEC, parsed by the library's one grammar."""
        w = "Model.new_cache"
        sp = ffi.new("kvpq_cache_spec *")
        _check(lib.kvpq_cache_spec_parse(_text(spec, w), sp), w)
        if sp.cuda:
            raise _arg_error(w, f"cache '{spec}': :cuda is the CLI's GPU cache; from Python use KVPQCache on CUDA tensors")
        for name, given, parsed in (("window", window, sp.window), ("sinks", sinks, sp.sinks)):
            if given is not None and parsed >= 0 and given != parsed:
                raise _arg_error(w, f"cache '{spec}': {name}={given} and the SPEC's {parsed} disagree")
        window = window if window is not None else (sp.window if sp.window >= 0 else None)
        sinks = sinks if sinks is not None else (sp.sinks if sp.sinks >= 0 else None)
        kind = ffi.string(lib.kvpq_cache_type_name(sp.type)).decode()
        if sp.tq_bits:
            i = self.info
            from ._turboquant import turboquant_codebook
            codebook = turboquant_codebook(i["n_layer"], i["n_head_kv"], i["head_dim"], sp.tq_bits)
        elif sp.path[0] != b"\0" and codebook is None:
            codebook = Codebook.load(ffi.string(sp.path).decode())
        return kind, codebook, window, sinks

    def eval(self, cache: Cache, tokens: ArrayLike, logits_all: bool = False,
             query_absmax: Optional[NDArray[np.float32]] = None) -> NDArray[np.float32]:
        """Run tokens (n,) int32 at the positions after those cache holds, appending their K/V.
        Returns logits (n, n_vocab) float32 if logits_all, else (n_vocab,) of the last token.
        query_absmax: None, or a float32 array (n_layer, n_head_kv, head_dim) raised in place to the
        largest |q| per KV head's query group and channel (kvpq_model_eval_query_absmax; zero it
        once, then pass it to every eval of the calibration text, then to kvpq.calibrate)."""
        tokens = _array(tokens, "tokens", "Model.eval", dtype=np.int32, shape=(None,))
        nv = self.info["n_vocab"]
        out = np.empty((len(tokens), nv) if logits_all else (nv,), np.float32)
        if query_absmax is None:
            _check(lib.kvpq_model_eval(self._h, cache._h, _ptr(tokens, "int32_t *"), len(tokens),
                                       int(bool(logits_all)), _ptr(out)), "Model.eval")
            return out
        inf = self.info
        if not (isinstance(query_absmax, np.ndarray) and query_absmax.dtype == np.float32
                and query_absmax.flags.c_contiguous and query_absmax.flags.writeable):
            raise _arg_error("Model.eval", "query_absmax: expected a writable C-contiguous float32 numpy array")
        _array(query_absmax, "query_absmax", "Model.eval", shape=(inf["n_layer"], inf["n_head_kv"], inf["head_dim"]))
        _check(lib.kvpq_model_eval_query_absmax(self._h, cache._h, _ptr(tokens, "int32_t *"), len(tokens),
                                                int(bool(logits_all)), _ptr(out), _ptr(query_absmax)), "Model.eval")
        return out

    def eval_batch(self, caches: Sequence[Cache], tokens: Sequence[ArrayLike]) -> NDArray[np.float32]:
        """Several sequences in one forward pass (kvpq_model_eval_batch): tokens[i] (n_i,) int32 run
        at the positions after those caches[i] holds, appending their K/V there; the weights are
        read once for all of them. Returns (n_seq, n_vocab) float32, row i the logits of sequence
        i's last token, equal to Model.eval(caches[i], tokens[i]) (the same bits with the default
        activations). Each cache at most once."""
        where = "Model.eval_batch"
        if len(caches) != len(tokens) or not caches:
            raise _arg_error(where, f"caches ({len(caches)}) and tokens ({len(tokens)}): expected one or more of each, "
                                    "as many caches as token arrays")
        toks = [_array(t, f"tokens[{i}]", where, dtype=np.int32, shape=(None,)) for i, t in enumerate(tokens)]
        for i, c in enumerate(caches):
            if not isinstance(c, Cache):
                raise _arg_error(where, f"caches[{i}]: expected a kvpq.Cache, got {type(c).__name__}")
        n = len(caches)
        out = np.empty((n, self.info["n_vocab"]), np.float32)
        c_caches = ffi.new("kvpq_cache *[]", [c._h for c in caches])
        c_toks = ffi.new("int32_t *[]", [_ptr(t, "int32_t *") for t in toks])
        c_n = ffi.new("int[]", [len(t) for t in toks])
        _check(lib.kvpq_model_eval_batch(self._h, n, c_caches, c_toks, c_n, _ptr(out)), where)
        return out


class Vocab:
    """A GGUF file's tokenizer alone (kvpq_vocab: byte-level BPE)."""

    def __init__(self, gguf_path: PathLike) -> None:
        h = ffi.new("kvpq_vocab **")
        _check(lib.kvpq_vocab_load(h, os.fsencode(gguf_path)), f"Vocab('{gguf_path}')")
        self._h = ffi.gc(h[0], lib.kvpq_vocab_free)

    @property
    def n_tokens(self) -> int:
        return int(lib.kvpq_vocab_n_tokens(self._h))

    @property
    def bos(self) -> int:
        return int(lib.kvpq_vocab_bos(self._h))

    @property
    def eos(self) -> int:
        return int(lib.kvpq_vocab_eos(self._h))

    def tokenize(self, text: Union[str, bytes], add_bos: bool = False, parse_special: bool = False
                 ) -> NDArray[np.int32]:
        b = _text(text, self.__class__.__name__ + ".tokenize")
        n = ffi.new("size_t *")
        _check(lib.kvpq_vocab_tokenize(self._h, b, len(b), int(add_bos), int(parse_special), ffi.NULL, 0, n),
               "Vocab.tokenize")
        out = np.empty(n[0], np.int32)
        _check(lib.kvpq_vocab_tokenize(self._h, b, len(b), int(add_bos), int(parse_special), _ptr(out, "int32_t *"),
                                       n[0], n), "Vocab.tokenize")
        return out

    def piece(self, token: int) -> bytes:
        n = ffi.new("size_t *")
        buf = ffi.new("char[]", 256)
        token = _int(token, "token", "Vocab.piece")
        _check(lib.kvpq_vocab_piece(self._h, token, buf, 256, n), "Vocab.piece")
        if n[0] > 256:
            buf = ffi.new("char[]", n[0])
            _check(lib.kvpq_vocab_piece(self._h, token, buf, n[0], n), "Vocab.piece")
        return ffi.buffer(buf, n[0])[:]


def gguf_dequantize(path: PathLike, name: str) -> NDArray[np.float32]:
    """One tensor of a GGUF file dequantized to float32 (kvpq_gguf_dequantize_tensor), flat
    (ne[0]*ne[1]*...,) with ne[0] fastest; reshape as the caller knows."""
    n = ffi.new("size_t *")
    _check(lib.kvpq_gguf_dequantize_tensor(os.fsencode(path), name.encode(), ffi.NULL, 0, n), "gguf_dequantize")
    out = np.empty(n[0], np.float32)
    _check(lib.kvpq_gguf_dequantize_tensor(os.fsencode(path), name.encode(), _ptr(out), n[0], n), "gguf_dequantize")
    return out
