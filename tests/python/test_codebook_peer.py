"""Codebook files against the reference safetensors implementation (PyPI `safetensors`).

A file kvpq writes (through the C API, by the kvpq package) must be read
by safetensors with the documented names, shapes, values and metadata; a file safetensors writes
with those names and metadata must be loaded by kvpq with the same values.
"""
import os
from types import SimpleNamespace as NS

import numpy as np
import pytest

st_numpy = pytest.importorskip("safetensors.numpy", reason="the safetensors package is not installed")
from safetensors import safe_open  # noqa: E402

import kvpq  # noqa: E402

SHARED, SUBSPACE = "shared", "subspace"


def _params(key_gran, value_gran):
    return NS(n_layer=3, n_head_kv=2, head_dim=16,
              key=NS(d=16, M=4, nbits=8, granularity=key_gran),     # dsub 4, ksub 256
              value=NS(d=16, M=8, nbits=3, granularity=value_gran),  # dsub 2, ksub 8
              value_rotate=1, key_norm=0, value_norm=0)


def _new(p):
    return kvpq.Codebook(p.n_layer, p.n_head_kv, p.head_dim, keys=(p.key.M, p.key.nbits),
                         values=(p.value.M, p.value.nbits), granularity=(p.key.granularity, p.value.granularity),
                         value_rotate=p.value_rotate, key_norm=p.key_norm, value_norm=p.value_norm)


def _book_shape(q):
    ksub, dsub = 1 << q.nbits, q.d // q.M
    return (q.M, ksub, dsub) if q.granularity == SUBSPACE else (ksub, dsub)


def _expected_tensors(p, rng, version=3):
    """Random tensors with the documented names and shapes: name -> float32 array. Format version 1
    files have no k.mean."""
    out = {}
    for i in range(p.n_layer):
        out[f"layers.{i}.k.smooth"] = rng.uniform(0.01, 4.0, (p.n_head_kv, p.head_dim)).astype(np.float32)
        if version >= 2:
            out[f"layers.{i}.k.mean"] = rng.uniform(-3.0, 3.0, (p.n_head_kv, p.head_dim)).astype(np.float32)
        out[f"layers.{i}.k.codebook"] = rng.standard_normal(_book_shape(p.key)).astype(np.float32)
        out[f"layers.{i}.v.codebook"] = rng.standard_normal(_book_shape(p.value)).astype(np.float32)
    return out


def _config_meta(p, version=3):
    meta = {
        "kvpq.format_version": str(version), "n_layer": str(p.n_layer), "n_head_kv": str(p.n_head_kv),
        "head_dim": str(p.head_dim), "k.M": str(p.key.M), "k.nbits": str(p.key.nbits),
        "k.granularity": p.key.granularity, "v.M": str(p.value.M), "v.nbits": str(p.value.nbits),
        "v.granularity": p.value.granularity, "v.rotate": str(p.value_rotate),
    }
    if version >= 3:  # norm-explicit quantizers (format version 3)
        meta.update({"k.norm": str(p.key_norm), "v.norm": str(p.value_norm)})
    return meta


FREE_META = {"model": "SmolLM2-135M-Instruct.Q4_1.gguf", "text": "emma.txt \u2713 \"quoted\"", "tokens": "4096"}


@pytest.mark.parametrize("key_gran,value_gran", [(SHARED, SUBSPACE), (SUBSPACE, SHARED)])
def test_kvpq_file_is_read_by_safetensors(tmp_path, key_gran, value_gran):
    p = _params(key_gran, value_gran)
    want = _expected_tensors(p, np.random.default_rng(1))
    cb = _new(p)
    for i in range(p.n_layer):
        cb.set_key_smooth(i, want[f"layers.{i}.k.smooth"])
        cb.set_key_mean(i, want[f"layers.{i}.k.mean"])
        cb.key_pq(i).centroids = want[f"layers.{i}.k.codebook"]
        cb.value_pq(i).centroids = want[f"layers.{i}.v.codebook"]
    for k, v in FREE_META.items():
        cb.set_meta(k, v)
    path = tmp_path / "kvpq.safetensors"
    cb.save(path)

    got = st_numpy.load_file(str(path))
    assert sorted(got) == sorted(want)
    for name, a in want.items():
        assert got[name].dtype == np.float32, name
        assert got[name].shape == a.shape, name
        assert np.array_equal(got[name].view(np.uint32), a.view(np.uint32)), name  # bit-identical
    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata()
    assert meta == {**_config_meta(p), **FREE_META}


@pytest.mark.parametrize("key_gran,value_gran,version", [(SHARED, SHARED, 3), (SUBSPACE, SUBSPACE, 2),
                                                         (SHARED, SUBSPACE, 1)])
def test_safetensors_file_is_loaded_by_kvpq(tmp_path, key_gran, value_gran, version):
    p = _params(key_gran, value_gran)
    if version >= 3:
        p.key_norm, p.value_norm = 1, 0
    want = _expected_tensors(p, np.random.default_rng(2), version)
    path = tmp_path / "peer.safetensors"
    # The reference writer orders tensors its own way (not ours) and pads the header itself.
    st_numpy.save_file(want, str(path), metadata={**_config_meta(p, version), **FREE_META})

    cb = kvpq.Codebook.load(path)
    q = cb.info()
    assert (q["n_layer"], q["n_head_kv"], q["head_dim"], q["value_rotate"]) == (3, 2, 16, True)
    assert (q["key_norm"], q["value_norm"]) == ((True, False) if version >= 3 else (False, False))
    assert q["key"] == {"d": 16, "M": 4, "nbits": 8, "granularity": key_gran}
    assert q["value"] == {"d": 16, "M": 8, "nbits": 3, "granularity": value_gran}
    for i in range(p.n_layer):
        assert np.array_equal(cb.key_smooth(i), want[f"layers.{i}.k.smooth"])
        want_mu = want[f"layers.{i}.k.mean"] if version >= 2 else np.zeros((2, 16), np.float32)  # v1: mu = 0
        assert np.array_equal(cb.key_mean(i), want_mu)
        assert np.array_equal(cb.key_pq(i).centroids, want[f"layers.{i}.k.codebook"]), (i, "k")
        assert np.array_equal(cb.value_pq(i).centroids, want[f"layers.{i}.v.codebook"]), (i, "v")
    for k, v in FREE_META.items():
        assert cb.get_meta(k) == v


def test_safetensors_file_with_wrong_shape_is_rejected_by_kvpq(tmp_path):
    p = _params(SHARED, SHARED)
    want = _expected_tensors(p, np.random.default_rng(3))
    want["layers.2.v.codebook"] = want["layers.2.v.codebook"][:7]  # 7 centroids, 8 expected
    path = tmp_path / "bad.safetensors"
    st_numpy.save_file(want, str(path), metadata=_config_meta(p))
    with pytest.raises(kvpq.Error) as e:
        kvpq.Codebook.load(path)
    assert e.value.status == -4  # KVPQ_ERR_FORMAT
    assert "tensor layers.2.v.codebook has shape [7,2], expected [8,2]" in e.value.detail
    # Float16 tensors are rejected by dtype, naming the tensor.
    want = _expected_tensors(p, np.random.default_rng(3))
    want["layers.0.k.smooth"] = want["layers.0.k.smooth"].astype(np.float16)
    st_numpy.save_file(want, str(path), metadata=_config_meta(p))
    with pytest.raises(kvpq.Error) as e:
        kvpq.Codebook.load(path)
    assert e.value.status == -4
    assert "tensor layers.0.k.smooth has dtype F16, expected F32" in str(e.value)


def test_cli_info_reports_a_safetensors_written_file(tmp_path):
    import subprocess

    p = _params(SHARED, SUBSPACE)
    want = _expected_tensors(p, np.random.default_rng(4))
    want["layers.1.k.smooth"][1, 5] = 0.03125  # the layer's minimum
    want["layers.1.k.smooth"][0, 0] = 7.5      # and maximum
    path = tmp_path / "peer.safetensors"
    st_numpy.save_file(want, str(path), metadata={**_config_meta(p), **FREE_META})
    out = subprocess.run([os.environ["KVPQ_BIN"], "info", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "version 3" in text
    assert "n_layer=3 n_head_kv=2 head_dim=16 value_rotate=1 key_norm=0 value_norm=0" in text
    assert "bits/element (K and V together, codes and per-vector scales): 1.750" in text
    assert "M=4 dsub=4 nbits=8 ksub=256 granularity=shared  2.000 bits/element" in text
    assert "M=8 dsub=2 nbits=3 ksub=8 granularity=subspace  1.500 bits/element" in text
    assert "v.codebook [8,8,2]" in text
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in text
    row = [line.split() for line in text.splitlines() if line.split()[:1] == ["1"]][0]
    assert float(row[1]) == 0.03125 and float(row[2]) == 7.5

    data = path.read_bytes()
    bad = tmp_path / "cut.safetensors"
    bad.write_bytes(data[: len(data) // 2])
    out = subprocess.run([os.environ["KVPQ_BIN"], "info", str(bad)], capture_output=True, text=True)
    assert out.returncode != 0
    assert "bad file format" in out.stderr and "cut.safetensors" in out.stderr


@pytest.mark.parametrize("key_gran", [SHARED, SUBSPACE])
def test_per_layer_key_M_both_directions(tmp_path, key_gran):
    """A file with per-layer key M (metadata k.M.{i}, key tensors of each layer's shape) written by
    safetensors loads in kvpq with those M and values; kvpq's re-save reads back in safetensors
    identical; kvpq info lists the differing layers."""
    import subprocess

    p = _params(key_gran, SHARED)
    layer_M = {1: 8, 2: 16}  # dsub 2 and 1; layer 0 keeps k.M = 4 (dsub 4)
    want = _expected_tensors(p, np.random.default_rng(5))
    for i, M in layer_M.items():
        q = NS(d=p.key.d, M=M, nbits=p.key.nbits, granularity=key_gran)
        want[f"layers.{i}.k.codebook"] = np.random.default_rng(i).standard_normal(_book_shape(q)).astype(np.float32)
    meta = {**_config_meta(p), **{f"k.M.{i}": str(M) for i, M in layer_M.items()}, **FREE_META}
    path = tmp_path / "peer_mix.safetensors"
    st_numpy.save_file(want, str(path), metadata=meta)

    cb = kvpq.Codebook.load(path)
    out = tmp_path / "kvpq_mix.safetensors"
    assert cb.params.key.M == 4
    assert cb.info()["key_M"] == [4, 8, 16]
    assert cb.get_meta("k.M.1") == "8"
    for i in range(3):
        assert np.array_equal(cb.key_pq(i).centroids, want[f"layers.{i}.k.codebook"]), i
    cb.save(out)
    got = st_numpy.load_file(str(out))
    assert sorted(got) == sorted(want)
    for name, a in want.items():
        assert got[name].shape == a.shape and np.array_equal(got[name].view(np.uint32), a.view(np.uint32)), name
    with safe_open(str(out), framework="numpy") as f:
        assert f.metadata() == meta

    info = subprocess.run([os.environ["KVPQ_BIN"], "info", str(out)], capture_output=True, text=True)
    assert info.returncode == 0, info.stderr
    assert "key layers 1-1 M=8 dsub=2 nbits=8" in info.stdout
    assert "key layers 2-2 M=16 dsub=1 nbits=8" in info.stdout
    # Metadata and tensor disagreeing: refused, naming the key's metadata.
    want["layers.2.k.codebook"] = want["layers.1.k.codebook"]
    st_numpy.save_file(want, str(path), metadata=meta)
    with pytest.raises(kvpq.Error) as e:
        kvpq.Codebook.load(path)
    assert e.value.status == -4  # KVPQ_ERR_FORMAT
    assert "(metadata k.M.2=16)" in e.value.detail


@pytest.mark.parametrize("value_gran", [SHARED, SUBSPACE])
def test_per_layer_value_M_both_directions(tmp_path, value_gran):
    """Per-layer value M (metadata v.M.{i}, value tensors of each layer's shape), as for keys: a
    safetensors-written file loads with those M and values, kvpq's re-save reads back identical in
    safetensors, kvpq info lists the differing value layers, a disagreeing tensor is refused."""
    import subprocess

    p = _params(SHARED, value_gran)
    layer_M = {0: 4, 2: 16}  # dsub 4 and 1; layer 1 keeps v.M = 8
    want = _expected_tensors(p, np.random.default_rng(6))
    for i, M in layer_M.items():
        q = NS(d=p.value.d, M=M, nbits=p.value.nbits, granularity=value_gran)
        want[f"layers.{i}.v.codebook"] = np.random.default_rng(10 + i).standard_normal(_book_shape(q)).astype(np.float32)
    meta = {**_config_meta(p), **{f"v.M.{i}": str(M) for i, M in layer_M.items()}, **FREE_META}
    path = tmp_path / "peer_vmix.safetensors"
    st_numpy.save_file(want, str(path), metadata=meta)

    cb = kvpq.Codebook.load(path)
    assert cb.info()["value_M"] == [4, 8, 16]
    for i in range(3):
        assert np.array_equal(cb.value_pq(i).centroids, want[f"layers.{i}.v.codebook"]), i
    out = tmp_path / "kvpq_vmix.safetensors"
    cb.save(out)
    got = st_numpy.load_file(str(out))
    for name, a in want.items():
        assert got[name].shape == a.shape and np.array_equal(got[name].view(np.uint32), a.view(np.uint32)), name
    with safe_open(str(out), framework="numpy") as f:
        assert f.metadata() == meta
    info = subprocess.run([os.environ["KVPQ_BIN"], "info", str(out)], capture_output=True, text=True)
    assert info.returncode == 0, info.stderr
    assert "value layers 0-0 M=4 dsub=4" in info.stdout
    assert "value layers 2-2 M=16 dsub=1" in info.stdout
    want["layers.2.v.codebook"] = want["layers.0.v.codebook"]
    st_numpy.save_file(want, str(path), metadata=meta)
    with pytest.raises(kvpq.Error) as e:
        kvpq.Codebook.load(path)
    assert e.value.status == -4
    assert "(metadata v.M.2=16)" in e.value.detail
