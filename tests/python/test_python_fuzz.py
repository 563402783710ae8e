"""Property-based fuzzing of the Python binding's argument checks (hypothesis, issue 14).

Every public function of kvpq that takes arrays gets random dtypes, shapes (zero sizes, one huge
dimension of a zero-size array, dimensions one off), layouts (Fortran order, transposed, strided,
reversed, broadcast with zero strides, read-only, misaligned), values (NaN, Inf, 3e38, denormals,
out-of-range integers), integers from -1 to 2**40 and objects that are no array at all. Each call
must either work (a result of the documented shape and dtype, the inputs left as they were; lists,
other dtypes and layouts are converted as numpy converts them) or raise
kvpq.Error, TypeError or ValueError whose message names the argument at fault. Any other exception
(OverflowError, MemoryError, IndexError, ...) fails the test; a crash ends pytest itself.

Examples per test: KVPQ_FUZZ_EXAMPLES (default 60, about 30 s for the file on the 2-core machine);
hypothesis prints the falsifying call and `@reproduce_failure` to replay it.
"""
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import kvpq  # noqa: E402

TRACE = os.environ.get("KVPQ_FUZZ_TRACE") == "1"  # print each call before making it (to find a crash)
EXAMPLES = int(os.environ.get("KVPQ_FUZZ_EXAMPLES", "60"))
# No shrinking: on the loaded 2-core machine it took over 5 minutes a failure; the traceback and
# the printed draws already name the call.
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, print_blob=True,
                suppress_health_check=list(HealthCheck),
                phases=[Phase.explicit, Phase.reuse, Phase.generate])
TINY_MODEL = Path(__file__).resolve().parents[1] / "fuzz" / "corpus" / "model" / "tiny_llama.gguf"

ALLOWED = (kvpq.Error, TypeError, ValueError)
DTYPES = [np.float32, np.float32, np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8, np.uint16,
          np.bool_, np.complex64, ">f4"]
DIMS = [0, 1, 2, 3, 4, 8, 16, 31, 32]
BIG = [2 ** 31 - 1, 2 ** 31, 2 ** 32 + 8, 2 ** 40]
INTS = [-(2 ** 31) - 1, -1, 0, 1, 2, 3, 4, 8, 255, 256, 2 ** 31 - 1] + BIG


@st.composite
def ints(draw, good=()):
    """An argument meant as an int: often one of `good`, else an edge value or not an int at all."""
    r = draw(st.integers(0, 9))
    if good and r < 5:
        return draw(st.sampled_from(list(good)))
    if r < 8:
        return draw(st.sampled_from(INTS))
    return draw(st.sampled_from([1.0, 2.5, "3", None, True, np.int64(2), np.uint64(2 ** 63)]))


@st.composite
def counts(draw, good):
    """An iteration count: like ints() without the huge positive values (2**31 k-means iterations are
    a valid request, not a bad argument)."""
    v = draw(ints(good))
    return 2 if isinstance(v, int) and not isinstance(v, bool) and v > 64 else v


def _values(draw, dtype, shape):
    n = int(np.prod(shape, dtype=np.int64))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    dt = np.dtype(dtype)
    if dt.kind == "f" or dt.kind == "c":
        x = rng.standard_normal(n).astype(dt)
        if n:
            special = draw(st.sampled_from(["none", "none", "none", "nan", "inf", "-inf", "huge", "denormal", "zero"]))
            i = draw(st.integers(0, n - 1))
            x[i] = {"none": x[i], "nan": np.nan, "inf": np.inf, "-inf": -np.inf, "huge": 3e38 if dt.itemsize >= 4
                    else 6e4, "denormal": 1e-40 if dt.itemsize >= 4 else 1e-7, "zero": 0}[special]
    elif dt.kind == "b":
        x = rng.integers(0, 2, n).astype(dt)
    else:
        info = np.iinfo(dt)
        hi = draw(st.sampled_from([4, 16, 256, int(info.max)]))
        x = rng.integers(max(int(info.min), -hi), min(int(info.max), hi), n, endpoint=True).astype(dt)
    return x.reshape(shape)


@st.composite
def arrays(draw, shape):
    """An argument meant as an array of `shape` (None: any size there): often exactly that as a
    C-contiguous float32 array, else another dtype, shape, layout, or no array."""
    r = draw(st.integers(0, 19))
    if r == 0:  # not an array
        return draw(st.sampled_from([None, 1.5, [1.0, 2.0], "x", [[1.0] * 4] * 2]))
    want = tuple(draw(st.sampled_from(DIMS)) if w is None else w for w in shape)
    if r <= 9:
        sh = want
    elif r <= 12:  # one dimension off by one, or one more / one less dimension
        sh = list(want)
        op = draw(st.integers(0, 2))
        if op == 0 and sh:
            i = draw(st.integers(0, len(sh) - 1))
            sh[i] = max(0, sh[i] + draw(st.sampled_from([-1, 1])))
        elif op == 1:
            sh.append(draw(st.sampled_from([1, 2])))
        elif sh:
            sh.pop()
        sh = tuple(sh)
    elif r <= 14:  # any shape
        sh = tuple(draw(st.lists(st.sampled_from(DIMS), max_size=4)))
    elif r == 15:  # a huge dimension of a zero-size array (C-contiguous, no memory)
        sh = list(want) or [0]
        i = draw(st.integers(0, len(sh) - 1))
        sh[i] = draw(st.sampled_from(BIG))
        j = draw(st.integers(0, len(sh) - 1))
        if j == i or sh[j] != 0:
            sh.insert(j if j != i else len(sh), 0)
        return np.empty(tuple(sh), np.float32)
    elif r == 16:  # a huge broadcast array: zero strides, read-only, next to no memory
        sh = list(want) or [1]
        sh[draw(st.integers(0, len(sh) - 1))] = draw(st.sampled_from(BIG))
        return np.broadcast_to(np.float32(1.0), tuple(sh))
    else:
        sh = want
    dtype = np.float32 if r <= 9 else draw(st.sampled_from(DTYPES))
    x = _values(draw, dtype, sh)
    layout = draw(st.sampled_from(["c"] * 6 + ["fortran", "transposed", "strided", "reversed", "readonly",
                                               "misaligned", "broadcast"])) if r >= 17 or r <= 9 else "c"
    if r <= 9 and draw(st.integers(0, 3)):
        layout = "c"
    if layout == "fortran":
        x = np.asfortranarray(x)
    elif layout == "transposed" and x.ndim >= 2:
        x = np.ascontiguousarray(np.swapaxes(x, 0, 1)).swapaxes(0, 1)
    elif layout == "strided" and x.ndim >= 1:
        big = np.repeat(x, 2, axis=-1)
        x = big[..., ::2]
    elif layout == "reversed" and x.ndim >= 1:
        x = x[::-1].copy()[::-1]
    elif layout == "readonly":
        x.flags.writeable = False
    elif layout == "misaligned" and x.size:
        buf = np.zeros(x.nbytes + 1, np.uint8)
        y = np.frombuffer(buf.data, dtype=x.dtype, count=x.size, offset=1).reshape(x.shape)
        y[...] = x
        x = y
    elif layout == "broadcast" and x.ndim >= 1 and x.shape[0] > 1:
        x = np.broadcast_to(x[:1], x.shape)
    return x


def _describe(a):
    if isinstance(a, np.ndarray):
        return f"array({a.dtype}, {a.shape}, strides={a.strides}, C={a.flags.c_contiguous}, aligned={a.flags.aligned})"
    return repr(a)[:40]


def _snapshot(args):
    """Copies of the writable array arguments (a huge broadcast one is read-only and holds one value)."""
    return [(a, a.copy()) for a in args if isinstance(a, np.ndarray) and a.flags.writeable and a.nbytes < 1 << 26]


# The library names an array argument by the documented names of its dimensions or its C name
# (x: (n, d); lam: lambda), so these count as naming it.
ALIASES = {"x": ("n", "d"), "lam": ("lambda", "n_head_kv"), "k": ("n_tokens",), "q": ("n_q", "n_head"),
           "codes": ("n",), "idx": ("n", "M"), "tokens": ("token",)}


def _names_argument(msg, names):
    names = list(names) + [a for n in names for a in ALIASES.get(n, ())]
    return any(re.search(r"(?<![A-Za-z_])" + re.escape(n) + r"(?![A-Za-z_])", msg) for n in names)


def call(fn, names, *args, **kw):
    """fn(*args, **kw) must return or raise an allowed error naming one of `names`; inputs unchanged.
    Returns the result, or None after an allowed error."""
    before = _snapshot(list(args) + list(kw.values()))
    if TRACE:
        print(f"call {getattr(fn, '__qualname__', fn)}({', '.join(_describe(a) for a in args)}"
              f"{''.join(f', {k}={_describe(v)}' for k, v in kw.items())})", file=sys.stderr, flush=True)
    try:
        out = fn(*args, **kw)
    except ALLOWED as e:
        msg = str(e)
        assert _names_argument(msg, names), f"{type(e).__name__} names none of {names}: {msg}"
        out = None
    for a, copy in before:
        assert np.array_equal(a, copy, equal_nan=True), "an input array was modified"
    return out


def _is_f32(a, shape):
    return isinstance(a, np.ndarray) and a.dtype == np.float32 and a.shape == shape


# ---- product quantizer, k-means, codes ------------------------------------------------------------

PQ = {g: kvpq.ProductQuantizer(8, M=4, nbits=3, granularity=g) for g in ("shared", "subspace")}
for _g, _pq in PQ.items():
    _pq.train(np.random.default_rng(1).standard_normal((64, 8)).astype(np.float32), niter=2)


@FUZZ
@given(st.sampled_from(["shared", "subspace"]), arrays((None, 8)), arrays((None, 2)), st.data())
def test_product_quantizer(gran, x, codes, data):
    pq = PQ[gran]
    out = call(pq.encode, ["x"], x)
    if out is not None:
        assert out.dtype == np.uint8 and out.shape == (np.shape(x)[0], 2)
    out = call(pq.assign, ["x"], x)
    if out is not None:
        assert out.dtype == np.uint16 and out.shape == (np.shape(x)[0], 4) and (out < 8).all()
    if isinstance(codes, np.ndarray) and codes.dtype == np.float32 and data.draw(st.booleans()):
        codes = codes.astype(np.uint8) if codes.size < 1 << 16 else codes
    out = call(pq.decode, ["codes"], codes)
    if out is not None:
        assert _is_f32(out, (np.shape(codes)[0], 8))
    p = kvpq.ProductQuantizer(8, M=4, nbits=3, granularity=gran)
    kw = data.draw(st.fixed_dictionaries({}, optional={"niter": counts((1, 2)), "seed": ints((0, 5)),
                                                       "max_points_per_centroid": ints((0, 4)),
                                                       "n_threads": counts((0, 1, 2)),
                                                       "init": st.sampled_from(["pp", "random", "x", None, 1])}))
    if isinstance(x, np.ndarray) and x.size > 4096:
        return
    call(p.train, ["x"] + list(kw), x, **kw)
    shape = (8, 2) if gran == "shared" else (4, 8, 2)
    c = data.draw(arrays(shape))
    try:
        p.centroids = c
        assert np.array_equal(p.centroids, np.asarray(c, np.float32))
    except ALLOWED as e:
        assert _names_argument(str(e), ["centroids"]), str(e)


@FUZZ
@given(arrays((None, None)), ints((1, 2, 3, 4)), st.data())
def test_kmeans(x, k, data):
    kw = data.draw(st.fixed_dictionaries({}, optional={"niter": counts((1, 2)), "seed": ints((0, 5)),
                                                       "max_points_per_centroid": ints((0, 4)),
                                                       "init": st.sampled_from(["pp", "random", "x"])}))
    out = call(kvpq.kmeans, ["x", "k"] + list(kw), x, k, n_threads=1, **kw)
    if out is not None:
        cent, rep = out
        assert _is_f32(cent, (k, np.shape(x)[1])) and np.isfinite(cent).all()


@FUZZ
@given(arrays((None, None)), ints((1, 2, 3, 4, 8, 12, 16)), ints((1, 2, 3, 4, 8)), st.data())
def test_codes_pack_unpack(idx, nbits, M, data):
    if isinstance(idx, np.ndarray) and data.draw(st.booleans()):
        idx = idx.astype(np.uint16) if idx.size < 1 << 16 else idx
    out = call(kvpq.codes_pack, ["idx", "nbits"], idx, nbits)
    if out is not None:
        assert out.dtype == np.uint8 and out.shape[0] == np.shape(idx)[0]
        back = kvpq.codes_unpack(out, np.shape(idx)[1], nbits)
        assert np.array_equal(back, idx)
    packed = data.draw(arrays((None, None)))
    if isinstance(packed, np.ndarray) and packed.size < 1 << 16 and data.draw(st.booleans()):
        packed = packed.astype(np.uint8)
    out = call(kvpq.codes_unpack, ["packed", "M", "nbits"], packed, M, nbits)
    if out is not None:
        assert out.dtype == np.uint16 and out.shape == (np.shape(packed)[0], M) and (out >> nbits == 0).all()


# ---- key transforms ---------------------------------------------------------------------------

@FUZZ
@given(arrays((None, 16)))
def test_hadamard_and_normalize_rows(x):
    out = call(kvpq.hadamard, ["x"], x)
    if out is not None:
        assert _is_f32(out, np.shape(x))
    out = call(kvpq.normalize_rows, ["x"], x)
    if out is not None:
        u, norms = out
        assert _is_f32(u, np.shape(x)) and _is_f32(norms, np.shape(x)[:-1])


@FUZZ
@given(arrays((None, 2, 8)), arrays((2, 8)), arrays((None, 4, 8)), st.sampled_from([1e-2, 0.0, -1.0, np.nan, np.inf,
                                                                                  1e30, "x", None]), st.booleans())
def test_smoothing(k, lam, q, floor, inverse):
    out = call(kvpq.smooth_compute, ["k", "floor"], k, floor)
    if out is not None:
        assert _is_f32(out, np.shape(k)[1:])
    out = call(kvpq.smooth_apply, ["x", "lam"], k, lam, inverse=inverse)
    if out is not None:
        assert _is_f32(out, np.shape(k))
    out = call(kvpq.smooth_apply_query, ["q", "lam"], q, lam)
    if out is not None:
        assert _is_f32(out, np.shape(q))


# ---- codebooks and calibration ----------------------------------------------------------------

def _codebook(n_layer=2):
    return kvpq.Codebook(n_layer, 2, 8, keys=(4, 3), values=(2, 3))


@FUZZ
@given(ints((0, 1)), arrays((2, 8)), arrays((2, 8)))
def test_codebook_setters(layer, lam, mu):
    cb = _codebook()
    call(cb.set_key_smooth, ["layer", "lam"], layer, lam)
    call(cb.set_key_mean, ["layer", "mu"], layer, mu)


@FUZZ
@given(ints((0, 1)), arrays((None, 2, 8)), arrays((None, 2, 8)), st.data())
def test_calibrate_layer(layer, k, v, data):
    if isinstance(k, np.ndarray) and isinstance(v, np.ndarray) and data.draw(st.booleans()) and k.ndim == 3 and v.ndim:
        v = v[: k.shape[0]] if v.shape[0] >= k.shape[0] else v
    if any(isinstance(a, np.ndarray) and a.size > 4096 for a in (k, v)):
        return
    cb = _codebook()
    call(kvpq.calibrate_layer, ["layer", "k", "v", "codebook"], cb, layer, k, v, niter=1, n_threads=1)


@FUZZ
@given(arrays((2, None, 2, 8)), arrays((2, None, 2, 8)))
def test_calibrate(K, V):
    if any(isinstance(a, np.ndarray) and a.size > 4096 for a in (K, V)):
        return
    for kv in ((K, V), [(K, V)], [(K, V), (V, K)]):
        out = call(kvpq.calibrate, ["keys_values", "K", "V", "k (layer 0)", "k (layer 1)", "k", "v"], kv,
                   keys=(4, 3), niter=1, n_threads=1)
        if out is not None:
            assert isinstance(out, kvpq.Codebook)


# ---- caches ---------------------------------------------------------------------------------------

# Every cache kind, and the variants kvpq.Cache takes: attention sinks, a sliding window (layer 0
# local), and VQ codebooks with one book per sub-space, per KV head, or two key stages (residual).
KINDS = ["fp32", "fp16", "q8_0", "q4_0", "q8_0r", "q4_0r", "kivi2", "kivi4", "vq"]
CB = kvpq.Codebook(2, 2, 32, keys="d4b8")
CBS = {"shared": CB, "subspace": kvpq.Codebook(2, 2, 32, keys="d4b8", granularity="subspace"),
       "head": kvpq.Codebook(2, 2, 32, keys="d4b8", granularity="head"),
       "residual": kvpq.Codebook(2, 2, 32, keys="d4b8", keys2="d8b8"),
       "head-residual": kvpq.Codebook(2, 2, 32, keys="d4b8", keys2="d8b8", granularity="head")}


def test_every_cache_kind_is_fuzzed():
    """A kind the package takes (kvpq.Cache's kinds, the C enum's names) that test_cache does not draw
    fails here."""
    from kvpq import _core
    assert sorted(KINDS) == sorted(_core._CACHE_KINDS)
    assert sorted(_core._CACHE_KINDS.values()) == list(range(len(_core._CACHE_KINDS)))


@FUZZ
@given(st.sampled_from(KINDS), ints((0, 1)), ints((0, 1, 2, 3)), ints((0, 1, 2, 3, 5)), ints((0, 1, 3, 9)), st.data())
def test_cache(kind, layer, pos0, n, n_pos, data):
    hd = 64 if kind in ("q8_0r", "q4_0r") else 32  # the rotated kinds need head_dim % 64 == 0
    k = data.draw(arrays((None, 2, hd)))
    v = data.draw(arrays((None, 2, hd)))
    q = data.draw(arrays((None, 4, hd)))
    kw = {}
    if kind == "vq":
        kw["codebook"] = CBS[data.draw(st.sampled_from(sorted(CBS)))]
    if kind not in ("fp32", "fp16") and data.draw(st.booleans()):
        kw["sinks"] = data.draw(ints((1, 3)))
    if data.draw(st.booleans()):
        kw["sliding_window"] = data.draw(ints((2, 4)))
        kw["swa_layers"] = data.draw(st.sampled_from([None, [1, 0], [0, 1], [1], "x"]))
    c = call(kvpq.Cache, ["sinks", "sliding_window", "swa_layers"], kind, 2, 4, 2, hd, 64, window=8, n_threads=1, **kw)
    if c is None:
        return
    call(c.append, ["layer", "k", "v"], layer, k, v)
    out = call(c.attend, ["layer", "q"], layer, q)
    if out is not None:
        assert _is_f32(out, np.shape(q))
    out = call(c.read, ["layer", "pos0", "n"], layer, pos0, n)
    if out is not None:
        kk, vv = out
        assert _is_f32(kk, (n, 2, hd)) and _is_f32(vv, (n, 2, hd))
    call(c.truncate, ["n_pos"], n_pos)
    call(c.read, ["layer", "pos0", "n"], 0, pos0)  # n: the rest
    call(c.seq_len, ["layer"], layer)


@FUZZ
@given(ints((1, 2)), ints((1, 2)), ints((32,)), ints((4, 64)), ints((None, 0, 8, 200)), ints((None, 1, 8)))
def test_cache_construction(n_layer, n_head_kv, head_dim, max_seq, window, page_tokens):
    kw = {"window": window, "page_tokens": page_tokens} if window is not None and page_tokens is not None else {}
    call(kvpq.Cache, ["n_layer", "n_head", "n_head_kv", "head_dim", "max_seq", "window", "page_tokens", "kind"],
         "q4_0", n_layer, 4, n_head_kv, head_dim, max_seq, n_threads=1, **kw)


# ---- model and vocabulary ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    if not TINY_MODEL.exists():
        pytest.skip(f"{TINY_MODEL} missing")
    return kvpq.Model(str(TINY_MODEL), n_threads=1), kvpq.Vocab(str(TINY_MODEL))


@FUZZ
@given(arrays((None,)), ints((0, 1, 6, 7)), st.booleans(), st.data())
def test_model_eval_and_pieces(tiny, tokens, token, logits_all, data):
    m, voc = tiny
    if isinstance(tokens, np.ndarray) and tokens.size < 64 and data.draw(st.booleans()):
        tokens = tokens.astype(np.int32)
    c = m.new_cache("fp32", max_seq=32, n_threads=1)
    out = call(m.eval, ["tokens"], c, tokens, logits_all=logits_all)
    if out is not None:
        nv = m.info["n_vocab"]
        assert _is_f32(out, (len(tokens), nv) if logits_all else (nv,))
    call(m.token_to_piece, ["token"], token)
    call(voc.piece, ["token"], token)
    text = data.draw(st.one_of(st.text(max_size=20), st.binary(max_size=20), st.sampled_from([None, 3, ["a"]])))
    call(m.tokenize, ["text"], text)
    call(voc.tokenize, ["text"], text)


def test_huge_thread_counts_refused_by_name():
    """Regression: n_threads = 2**31 - 1 reached OpenMP, and libgomp ended the process ("Out of memory
    allocating 481036338272 bytes") instead of returning; the library now refuses n_threads > 1024."""
    x = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    for fn in (lambda: kvpq.kmeans(x, 2, n_threads=2 ** 31 - 1),
               lambda: kvpq.ProductQuantizer(8, M=4, nbits=2).train(x, n_threads=1025),
               lambda: kvpq.Cache("fp16", 1, 2, 1, 8, 16, n_threads=2 ** 31 - 1)):
        with pytest.raises(kvpq.Error, match="n_threads"):
            fn()
    if TINY_MODEL.exists():
        with pytest.raises(kvpq.Error, match="n_threads"):
            kvpq.Model(str(TINY_MODEL), n_threads=5000)
