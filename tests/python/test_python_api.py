"""The numpy API of the kvpq package: a round trip through every entry point, against numpy
formulas written here, and the argument checks (dtype, shape, contiguity, NaN) that raise kvpq.Error
naming the argument."""
import numpy as np
import pytest

import kvpq

RNG = np.random.default_rng(20261201)


def rand(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def test_product_quantizer_round_trip():
    x = rand(3000, 32)
    for gran in ("shared", "subspace"):
        pq = kvpq.ProductQuantizer(32, M=8, nbits=6, granularity=gran)
        assert (pq.d, pq.M, pq.nbits, pq.dsub, pq.ksub, pq.code_size, pq.granularity) == (32, 8, 6, 4, 64, 6, gran)
        rep = pq.train(x, niter=8, seed=3)
        assert rep["iterations"] >= 1 and rep["mse_final"] <= rep["mse_init"]
        codes, idx = pq.encode(x), pq.assign(x)
        assert codes.dtype == np.uint8 and codes.shape == (3000, 6) and idx.shape == (3000, 8)
        assert np.array_equal(kvpq.codes_pack(idx, 6), codes)
        assert np.array_equal(kvpq.codes_unpack(codes, 8, 6), idx)
        y = pq.decode(codes)
        # decode is the gather of the centroids the indices name
        cent = pq.centroids
        book = cent[None].repeat(8, 0) if gran == "shared" else cent
        want = np.stack([book[m][idx[:, m]] for m in range(8)], 1).reshape(3000, 32)
        assert np.array_equal(y, want)
        # each index is the nearest centroid of its sub-vector (exact float64 distances; ties aside)
        sub = x.reshape(3000, 8, 4).astype(np.float64)
        d2 = ((sub[:, :, None, :] - book[None].astype(np.float64)) ** 2).sum(-1)  # (n, M, ksub)
        best = d2.min(-1)
        got = np.take_along_axis(d2, idx[..., None].astype(np.int64), -1)[..., 0]
        assert np.all(got <= best + 1e-5 * (1 + best))
        # the reported MSE is that of the trained codebook (subspace: all 3000 points used, no subsample)
        if gran == "subspace":
            assert abs(((x - y) ** 2).sum(1).mean() - rep["mse_final"]) <= 1e-3 * rep["mse_final"]
        # centroids set -> read back
        pq2 = kvpq.ProductQuantizer(32, M=8, nbits=6, granularity=gran)
        pq2.centroids = cent
        assert np.array_equal(pq2.encode(x), codes)


def test_preset_and_kmeans():
    pq = kvpq.ProductQuantizer(64, preset="d8b12")
    assert (pq.M, pq.nbits) == (8, 12)
    x = rand(4000, 4)
    cent, rep = kvpq.kmeans(x, 16, niter=10)
    assert cent.shape == (16, 4) and rep["n_used"] == 4000
    d2 = ((x[:, None, :].astype(np.float64) - cent[None]) ** 2).sum(-1).min(1).mean()
    assert abs(d2 - rep["mse_final"]) <= 1e-3 * d2


def test_transforms_against_numpy():
    x = rand(5, 3, 16)
    h = kvpq.hadamard(x)
    H = np.array([[1.0]])
    while H.shape[0] < 16:
        H = np.block([[H, H], [H, -H]])
    np.testing.assert_allclose(h, x @ (H / 4.0).T, atol=1e-5)
    np.testing.assert_allclose(kvpq.hadamard(h), x, atol=1e-5)  # self-inverse
    u, n = kvpq.normalize_rows(x)
    np.testing.assert_allclose(n, np.linalg.norm(x, axis=-1), rtol=1e-6)
    np.testing.assert_allclose(u, x / np.linalg.norm(x, axis=-1, keepdims=True), rtol=1e-5, atol=1e-7)
    k = rand(50, 2, 8, scale=3.0)
    k[:, 1, 4] = 0.0  # a silent channel: floored
    lam = kvpq.smooth_compute(k)
    want = np.maximum(np.sqrt(np.abs(k).max(0)), 1e-2)
    np.testing.assert_allclose(lam, want, rtol=1e-6)
    ks = kvpq.smooth_apply(k, lam)
    np.testing.assert_allclose(ks, k / lam, rtol=1e-6)
    np.testing.assert_allclose(kvpq.smooth_apply(ks, lam, inverse=True), k, rtol=1e-5, atol=1e-6)
    q = rand(4, 6, 8)  # GQA: 6 query heads over 2 KV heads
    qs = kvpq.smooth_apply_query(q, lam)
    np.testing.assert_allclose(qs, q * np.repeat(lam, 3, 0)[None], rtol=1e-6)
    # q . k unchanged
    np.testing.assert_allclose((qs[0, 4] * ks[7, 1]).sum(), (q[0, 4] * k[7, 1]).sum(), rtol=1e-4)


def test_codebook_save_load_info(tmp_path):
    cb = kvpq.Codebook(2, 3, 32, keys="d4b8", values="d8b8", value_rotate=True)
    lam = rand(3, 32) ** 2 + 0.5
    cb.set_key_smooth(1, lam)
    cb.set_key_mean(0, rand(3, 32))
    cb.key_pq(1).centroids = rand(256, 4)
    cb.set_meta("note", "hello \u2713")
    cb.save(tmp_path / "c.safetensors")
    back = kvpq.Codebook.load(tmp_path / "c.safetensors")
    assert np.array_equal(back.key_smooth(1), lam)
    assert np.array_equal(back.key_mean(0), cb.key_mean(0))
    assert np.array_equal(back.key_pq(1).centroids, cb.key_pq(1).centroids)
    info = back.info()
    assert info["key"]["M"] == 8 and info["value"]["M"] == 4 and info["value_rotate"] and info["key_norm"]
    assert info["bits_per_element"] == {"key": 2.0, "value": 1.0}
    assert info["meta"]["note"] == "hello \u2713" and back.get_meta("n_layer") == "2"


def test_codebook_slice_heads():
    """Codebook.slice_heads: KV heads [1, 3) of 3 layers' worth: their smoothing and mean rows, the same
    centroids, "heads" metadata; bad ranges refused by name."""
    cb = kvpq.Codebook(2, 3, 32, keys="d4b8")
    cb.set_key_smooth(1, rand(3, 32) ** 2 + 0.5)
    cb.set_key_mean(1, rand(3, 32))
    cb.key_pq(1).centroids = rand(256, 4)
    s = cb.slice_heads(1, 2)
    assert s.n_head_kv == 2 and s.get_meta("heads") == "1:3/3"
    assert np.array_equal(s.key_smooth(1), cb.key_smooth(1)[1:]) and np.array_equal(s.key_mean(1), cb.key_mean(1)[1:])
    assert np.array_equal(s.key_pq(1).centroids, cb.key_pq(1).centroids)
    with pytest.raises(kvpq.Error, match=r"KV heads \[2, 4\) outside"):
        cb.slice_heads(2, 2)


def test_calibrated_vq_cache_round_trip():
    L, H, D, n = 2, 2, 32, 400
    kv = [(rand(n, H, D, scale=2.0) + 1.0, rand(n, H, D)) for _ in range(L)]
    cb = kvpq.calibrate(kv, keys="d4b8", niter=4)
    np.testing.assert_allclose(cb.key_mean(0), kv[0][0].mean(0), atol=1e-5)
    # query_absmax is one (n_head_kv, head_dim) row per layer: another number of layers is refused by
    # name before any training (fewer raised a bare IndexError after layer 0 was trained, more were
    # silently ignored)
    for n_q in (L - 1, L + 1):
        with pytest.raises(kvpq.Error, match=r"query_absmax: expected shape \(2, 2, 32\)"):
            kvpq.calibrate(kv, keys="d4b8", niter=1, query_absmax=np.ones((n_q, H, D), np.float32))
    qa = np.ones((L, H, D), np.float32)
    qa[:, :, 0] = 4.0  # channel 0 weighted most by the queries: lambda^2 ~ max|k| / max|q| there
    cq = kvpq.calibrate(kv, keys="d4b8", niter=1, query_absmax=qa)
    assert cq.get_meta("key_smooth") == "query" and cb.get_meta("key_smooth") == "keys"
    assert np.all(cq.key_smooth(1)[:, 0] < cb.key_smooth(1)[:, 0])
    c = kvpq.Cache("vq", L, 4, H, D, max_seq=512, codebook=cb, window=16)
    for layer in range(L):
        c.append(layer, *kv[layer])
    assert c.seq_len(0) == n
    st = c.stats()
    assert st["tokens_window"] == 16 * L and st["tokens_coded"] == (n - 16) * L
    assert c.resident_bytes == st["resident_bytes"] > 0
    assert c.resident_bytes < 0.25 * (2 * L * n * H * D * 4)
    k, v = c.read(1)
    f16 = lambda a: a.astype(np.float16).astype(np.float32)  # noqa: E731  the window holds float16
    assert np.array_equal(k[-16:], f16(kv[1][0][-16:])) and np.array_equal(v[-16:], f16(kv[1][1][-16:]))
    rel = np.linalg.norm(k[:-16] - kv[1][0][:-16]) / np.linalg.norm(kv[1][0][:-16])
    assert 0 < rel < 0.5
    # attention from codes equals exact attention over what read() returns (float64 reference)
    q = rand(3, 4, D)
    c.truncate(n - 3)
    c.append(1, kv[1][0][n - 3:], kv[1][1][n - 3:])
    k, v = c.read(1)
    out = c.attend(1, q)
    for i in range(3):
        for h in range(4):
            p = n - 3 + i
            s = k[: p + 1, h // 2].astype(np.float64) @ q[i, h] / np.sqrt(D)
            w = np.exp(s - s.max())
            ref = (w / w.sum()) @ v[: p + 1, h // 2]
            np.testing.assert_allclose(out[i, h], ref, rtol=2e-3, atol=2e-4 * np.abs(ref).max())


def test_8bit_norm_scales_save_a_byte_per_vector_and_attend_from_codes():
    """calibrate(norm_bits=8): the VQ cache keeps one byte per (token, KV head) and kind instead of a
    float16 (plus a float reference per page and KV head), read() stays within the 8-bit code's 2.2%
    of the float16-scale cache, and attention from codes equals exact attention over read()."""
    L, H, D, n = 1, 2, 32, 300
    kv = [(rand(n, H, D, scale=2.0) + 1.0, rand(n, H, D)) for _ in range(L)]
    with pytest.raises(kvpq.Error, match="norm_bits: expected 8 or 16"):
        kvpq.calibrate(kv, keys="d4b8", niter=1, norm_bits=12)
    caches = []
    for nb in (16, 8):
        cb = kvpq.calibrate(kv, keys="d4b8", niter=4, norm_bits=nb)
        assert cb.get_meta("k.norm_bits") == (None if nb == 16 else "8")
        c = kvpq.Cache("vq", L, 4, H, D, max_seq=512, codebook=cb, window=0, page_tokens=64)
        c.append(0, *kv[0])
        caches.append(c)
    coded = n // 32 * 32
    pages = -(-coded // 64)
    assert caches[0].resident_bytes - caches[1].resident_bytes == 2 * (pages * 64 * H - pages * H * 4)
    (k16, v16), (k8, v8) = caches[0].read(0), caches[1].read(0)
    for a, b in ((k16, k8), (v16, v8)):  # same codes, scales within 2.2%
        sa = np.linalg.norm(a[:coded], axis=-1)
        sb = np.linalg.norm(b[:coded], axis=-1)
        assert np.all(np.abs(sb / sa - 1) < 0.0225) and np.any(sb != sa)
    q = rand(1, 4, D)
    out = caches[1].attend(0, q)
    for h in range(4):
        s = k8[:, h // 2].astype(np.float64) @ q[0, h] / np.sqrt(D)
        w = np.exp(s - s.max())
        ref = (w / w.sum()) @ v8[:, h // 2]
        np.testing.assert_allclose(out[0, h], ref, rtol=2e-3, atol=2e-4 * np.abs(ref).max())


@pytest.mark.parametrize("call,arg,msg", [
    (lambda pq, x: pq.encode(x.astype(np.complex64)), "x", "expected dtype float32, got complex64"),
    (lambda pq, x: pq.encode(x > 0), "x", "expected dtype float32, got bool"),
    (lambda pq, x: pq.encode("x"), "x", "expected an array of float32, got str"),
    (lambda pq, x: pq.encode([[1.0, 2.0], [3.0]]), "x", "not convertible to an array"),
    (lambda pq, x: pq.encode(x[:, :16]), "x", "expected shape (*, 32), got (100, 16)"),
    (lambda pq, x: pq.decode(np.zeros((3, 5), np.uint8)), "codes", "expected shape (*, 8), got (3, 5)"),
    (lambda pq, x: pq.decode(np.zeros((3, 8), np.float32)), "codes", "expected dtype uint8, got float32"),
    (lambda pq, x: pq.decode(np.full((3, 8), 256)), "codes", "values 256..256 do not fit uint8"),
    (lambda pq, x: pq.decode([[-1] * 8]), "codes", "values -1..-1 do not fit uint8"),
    (lambda pq, x: pq.train(x[:, :4]), "x", "expected shape (*, 32)"),
    (lambda pq, x: kvpq.smooth_apply(x.reshape(100, 2, 16), np.ones((3, 16), np.float32)), "lam",
     "expected shape (2, 16), got (3, 16)"),
    (lambda pq, x: kvpq.Cache("fp32", 1, 2, 1, 32, 8).append(0, x[:4].reshape(4, 1, 32), x[:3].reshape(3, 1, 32)),
     "v", "3 positions, k has 4"),
    (lambda pq, x: kvpq.Cache("fp32", 1, 2, 1, 32, 8).attend(0, x[:1].reshape(1, 1, 32)), "q",
     "expected shape (*, 2, 32), got (1, 1, 32)"),
    (lambda pq, x: kvpq.Cache("vq", 1, 2, 1, 32, 8), "codebook", "needs a kvpq.Codebook"),
    (lambda pq, x: kvpq.Cache("q3", 1, 2, 1, 32, 8), "kind", "'q3' is not one of"),
    (lambda pq, x: kvpq.Cache("fp32", 3, 2, 1, 32, 8, sliding_window=4, swa_layers=[1, 0]), "swa_layers",
     "2 flags for 3 layers"),
])
def test_bad_arguments_name_the_argument(call, arg, msg):
    pq = kvpq.ProductQuantizer(32, M=8, nbits=8)
    x = rand(100, 32)
    with pytest.raises(kvpq.Error) as e:
        call(pq, x)
    assert e.value.status == -1 and e.value.status_name == "invalid argument"
    assert f"{arg}: " in str(e.value) and msg in str(e.value), str(e.value)


def test_array_arguments_are_converted_as_numpy_converts():
    """Issue 33: lists, float64/float16, other integer widths and any memory layout are converted
    (np.asarray, numpy's 'same_kind' casting, a C-order copy), giving what the float32 / uint8 C-order
    array gives; the caller's array is not modified."""
    pq = kvpq.ProductQuantizer(32, M=8, nbits=8)
    x = rand(300, 32)
    pq.train(x, niter=2)
    codes = pq.encode(x)
    x64 = x.astype(np.float64)
    for same in (x64, x.tolist(), np.asfortranarray(x), x64[:, ::-1][:, ::-1], np.ascontiguousarray(x[::-1])[::-1]):
        assert np.array_equal(pq.encode(same), codes)
    assert x64.dtype == np.float64  # not converted in place
    h = x.astype(np.float16)
    assert np.array_equal(pq.encode(h), pq.encode(h.astype(np.float32)))
    for c in (codes.astype(np.int64), codes.tolist(), codes.astype(np.uint16)):
        assert np.array_equal(pq.decode(c), pq.decode(codes))
    k = rand(4, 1, 32)
    c = kvpq.Cache("fp32", 1, 2, 1, 32, 8)
    c.append(0, k.astype(np.float64).tolist(), k.astype(np.float64))
    assert np.array_equal(c.read(0)[0], k)
    assert np.array_equal(kvpq.hadamard(x.tolist()), kvpq.hadamard(x))
    with pytest.raises(kvpq.Error, match=r"x: holds NaN or Inf"):  # a float64 beyond float32's range
        pq.encode(np.full((1, 32), 1e39))


def test_errors_are_runtime_and_value_errors():
    """Issue 33: kvpq.Error is a RuntimeError; a bad argument (invalid argument, NaN/Inf, mismatch)
    is a kvpq.ArgumentError, also a ValueError, so code catching ValueError catches it."""
    assert issubclass(kvpq.Error, RuntimeError) and issubclass(kvpq.ArgumentError, kvpq.Error)
    assert issubclass(kvpq.ArgumentError, ValueError)
    pq = kvpq.ProductQuantizer(32, M=8, nbits=8)
    with pytest.raises(ValueError, match="x: expected shape"):
        pq.encode(rand(3, 16))
    with pytest.raises(ValueError, match="holds NaN"):
        pq.encode(np.full((1, 32), np.nan, np.float32))
    with pytest.raises(kvpq.Error) as e:  # a library error of another kind: RuntimeError, not ValueError
        kvpq.Codebook.load("/nonexistent/cb.safetensors")
    assert isinstance(e.value, RuntimeError) and not isinstance(e.value, ValueError), type(e.value).__mro__
    assert e.value.status == kvpq.lib.KVPQ_ERR_IO
    e2 = kvpq.Error(kvpq.lib.KVPQ_ERR_INVALID_ARG, "made by hand")  # the constructor picks the class too
    assert type(e2) is kvpq.ArgumentError and e2.detail == "made by hand"


def test_nan_and_library_errors():
    pq = kvpq.ProductQuantizer(32, M=8, nbits=8)
    x = rand(100, 32)
    x[7, 3] = np.inf
    with pytest.raises(kvpq.Error, match=r"x: holds NaN or Inf \(first at index \(7, 3\)\)") as e:
        pq.encode(x)
    assert e.value.status == -6
    k = rand(4, 1, 32)
    k[2, 0, 0] = np.nan
    with pytest.raises(kvpq.Error, match=r"k: holds NaN") as e:
        kvpq.Cache("fp32", 1, 2, 1, 32, 8).append(0, k, rand(4, 1, 32))
    # an error the library raises carries its status and kvpq_last_error() text
    with pytest.raises(kvpq.Error) as e:
        kvpq.ProductQuantizer(30, M=7, nbits=8)
    assert e.value.status == -1 and e.value.detail == kvpq.last_error() and "30" in e.value.detail
    with pytest.raises(kvpq.Error) as e:
        kvpq.Cache("fp32", 1, 2, 1, 32, 4).append(0, rand(5, 1, 32), rand(5, 1, 32))
    assert e.value.status == -10  # KVPQ_ERR_CAPACITY
    with pytest.raises(kvpq.Error) as e:
        kvpq.hadamard(rand(2, 12))
    assert e.value.status == -5 and "12" in e.value.detail


def test_sliding_window_cache_equals_attention_over_the_window():
    """A local layer (swa_layers[l] = 1) attends over the newest sliding_window positions only: its
    output equals an unwindowed cache's on those positions; a global layer is unchanged."""
    W, n, hd = 4, 11, 32
    k, v, q = rand(n, 1, hd), rand(n, 1, hd), rand(1, 2, hd)
    swa = kvpq.Cache("fp32", 2, 2, 1, hd, 16, sliding_window=W, swa_layers=[1, 0])
    full = kvpq.Cache("fp32", 1, 2, 1, hd, 16)
    last = kvpq.Cache("fp32", 1, 2, 1, hd, 16)
    for layer in (0, 1):
        swa.append(layer, k[:-1], v[:-1])
    full.append(0, k[:-1], v[:-1])
    last.append(0, k[n - W:-1], v[n - W:-1])
    for layer in (0, 1):
        swa.append(layer, k[-1:], v[-1:])
    full.append(0, k[-1:], v[-1:])
    last.append(0, k[-1:], v[-1:])
    np.testing.assert_allclose(swa.attend(0, q), last.attend(0, q), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(swa.attend(1, q), full.attend(0, q), rtol=1e-6, atol=1e-7)
    assert not np.allclose(swa.attend(0, q), full.attend(0, q))


def test_handles_freed_after_the_library_objects_died_do_not_crash():
    """At interpreter teardown the module dicts are cleared, the cffi library objects die and cffi
    dlcloses libkvpq*.so; handles freed later by the last garbage collection (a cycle holding a
    Cache or Model) then called their ffi.gc destructor in unmapped code: the full
    test_transformers.py run ended in SIGSEGV after passing. ffi.dlclose does here what teardown
    does; the libraries are opened RTLD_NODELETE, so the destructor still finds its code."""
    import subprocess
    import sys
    code = ("import kvpq, kvpq._ffi as F\n"
            "pq = kvpq.ProductQuantizer(d=16, M=4, nbits=4)\n"
            "F.ffi.dlclose(F.lib)\n"
            "if F._core_lib is not None and F._core_lib is not F.lib: F.ffi.dlclose(F._core_lib)\n"
            "del pq\n"
            "print('freed')\n")
    import os
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(kvpq.__file__))] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "freed", (r.returncode, r.stdout, r.stderr[-2000:])


def test_set_meta_refuses_a_nul_character():
    # Issue 31: set_meta("a\0b", ...) stored key "a" (the C string ended at the NUL).
    cb = kvpq.Codebook(n_layer=1, n_head_kv=1, head_dim=64)
    with pytest.raises(kvpq.Error, match="key: holds a NUL character at index 1"):
        cb.set_meta("a\0b", "x")
    with pytest.raises(kvpq.Error, match="value: holds a NUL character at index 2"):
        cb.set_meta("a", "xy\0z")
    cb.set_meta("a", "ok")
    assert cb.info()["meta"].get("a") == "ok" and "a\0b" not in cb.info()["meta"]


def _public_callables(mod):
    import inspect
    for name in getattr(mod, "__all__", [n for n in vars(mod) if not n.startswith("_")]):
        obj = getattr(mod, name)
        if inspect.isclass(obj) and obj.__module__.startswith("kvpq"):
            for m, f in vars(obj).items():
                f = f.fget if isinstance(f, property) else getattr(f, "__func__", f)
                if inspect.isfunction(f) and (not m.startswith("_") or m in ("__init__", "__enter__", "__exit__")):
                    yield f"{name}.{m}", f
        elif inspect.isfunction(obj) and obj.__module__.startswith("kvpq"):
            yield name, obj


def test_public_api_is_typed():
    """Issue 33: type hints and py.typed (PEP 561), so type checkers read the package's own hints:
    every parameter and the return of every public function and method of kvpq (and of
    kvpq.transformers' public names where torch is installed) is annotated."""
    import inspect
    from pathlib import Path
    assert (Path(kvpq.__file__).parent / "py.typed").is_file()
    mods = [kvpq]
    try:
        import kvpq.transformers as kt
        mods.append(kt)
    except ImportError:
        pass
    missing, n = [], 0
    for mod in mods:
        for name, f in _public_callables(mod):
            sig = inspect.signature(f)
            n += 1
            for p in sig.parameters.values():
                if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty:
                    missing.append(f"{name}({p.name})")
            if sig.return_annotation is inspect.Signature.empty:
                missing.append(f"{name} -> ?")
    assert n > 60 and not missing, (n, missing)
