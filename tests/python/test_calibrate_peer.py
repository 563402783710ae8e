"""`kvpq calibrate` on the real model, and the VQ cache it feeds, against independent peers.

The key statistics in the codebook file (per-(KV head, channel) mean mu and smoothing factors
lambda = sqrt(max |k - mu|)) are recomputed from post-RoPE keys of an independent numpy forward pass
(bench/llama_cpp_peer.py, weights dequantized by the PyPI `gguf` package); the file is read with the
PyPI `safetensors` package. Then `kvpq ppl` with the codebook: a window that holds the whole chunk
makes the VQ cache an fp16 cache (same perplexity), a window of 0 codes every token (it differs).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

st_numpy = pytest.importorskip("safetensors.numpy", reason="the safetensors package is not installed")

SRC = Path(os.environ.get("KVPQ_SOURCE_DIR", Path(__file__).resolve().parents[2]))
MODEL = SRC / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
CALIB = SRC / "data" / "text" / "emma.txt"
EVAL = SRC / "data" / "text" / "persuasion.txt"
BIN = os.environ.get("KVPQ_BIN", str(SRC / "build" / "kvpq"))
LIB = os.environ.get("KVPQ_LIB", str(SRC / "build" / "libkvpq.so"))
sys.path.insert(0, str(SRC / "bench"))
pytestmark = pytest.mark.skipif(not MODEL.exists(), reason=f"model {MODEL} missing (scripts/fetch_model.sh)")

TOKENS, CTX = 256, 128  # two forward chunks of 128 tokens


def run(*args, check=True):
    p = subprocess.run([BIN, *map(str, args)], capture_output=True, text=True, timeout=900)
    if check and p.returncode != 0:
        raise AssertionError(f"kvpq {' '.join(map(str, args))} failed ({p.returncode}): {p.stderr}")
    return p


@pytest.fixture(scope="module")
def codebook(tmp_path_factory):
    out = tmp_path_factory.mktemp("calib") / "cb_d4b8.safetensors"
    run("calibrate", "--model", MODEL, "--text", CALIB, "--tokens", TOKENS, "--ctx", CTX, "--keys", "d4b8",
        "--iters", 2, "--threads", 2, "-o", out)
    return out


def test_key_mean_and_smoothing_match_numpy_forward_pass(codebook):
    from llama_cpp_peer import Kvpq, NumpyLlama
    from safetensors import safe_open
    with safe_open(str(codebook), framework="numpy") as f:
        meta = f.metadata()
    t = st_numpy.load_file(str(codebook))
    assert meta["kvpq.format_version"] == "3" and meta["tokens"] == str(TOKENS) and meta["key_center"] == "1"
    assert meta["k.norm"] == "1" and meta["v.norm"] == "1"  # norm-explicit by default
    assert meta["key_smooth"] == "query"  # query-aware smoothing by default
    assert t["layers.0.k.codebook"].shape == (256, 4) and t["layers.29.v.codebook"].shape == (256, 4)
    # Norm-explicit quantizers are trained on unit directions: no centroid (a mean of sub-vectors of
    # unit vectors) is longer than 1, while the smoothed keys' own sub-vectors are (lambda^2 = max|K|).
    for name in ("layers.0.k.codebook", "layers.13.k.codebook", "layers.29.v.codebook"):
        assert np.linalg.norm(t[name], axis=-1).max() <= 1.0 + 1e-5, name

    kv = Kvpq(LIB, str(MODEL), 2)
    toks = kv.tokenize(CALIB.read_text(encoding="utf-8")[:20000], False)[:TOKENS]  # calibrate adds no BOS
    ref = NumpyLlama(str(MODEL))
    keys = [[] for _ in range(ref.n_layer)]
    queries = [[] for _ in range(ref.n_layer)]
    for c0 in range(0, TOKENS, CTX):
        col = []
        ref.forward(toks[c0:c0 + CTX], collect=col)
        for layer, (k, _, q) in enumerate(col):
            keys[layer].append(k)
            queries[layer].append(q)
    for layer in (0, 13, 29):
        k = np.concatenate(keys[layer]).astype(np.float64)  # (TOKENS, n_head_kv, head_dim)
        q = np.concatenate(queries[layer]).astype(np.float64)  # (TOKENS, n_head, head_dim)
        mu = k.mean(0)
        # query-aware smoothing (the default, kvpq_smooth_compute_qk): lambda^2 = max|k - mu| * qbar / qm,
        # qm = max |q| over the KV head's query group (GQA: heads h*g .. h*g+g-1), at least 1e-3 of the
        # head's largest, qbar its mean over channels; floored at 1e-2
        g = q.shape[1] // k.shape[1]
        qm = np.abs(q).reshape(q.shape[0], k.shape[1], g, -1).max((0, 2))
        qm = np.maximum(qm, 1e-3 * qm.max(1, keepdims=True))
        lam = np.maximum(np.sqrt(np.abs(k - mu).max(0) * qm.mean(1, keepdims=True) / qm), 1e-2)
        # not the keys-only factors: the queries moved them
        assert np.abs(lam / np.maximum(np.sqrt(np.abs(k - mu).max(0)), 1e-2) - 1).max() > 0.1
        scale = np.abs(k).max(0)  # per (head, channel)
        # fp32 forward passes in two implementations: keys agree to ~1e-4 of each channel's range.
        err = np.abs(t[f"layers.{layer}.k.mean"] - mu)
        assert (err <= 2e-3 * scale + 1e-5).all(), f"layer {layer} mu: worst {(err / (scale + 1e-9)).max():.2g}"
        np.testing.assert_allclose(t[f"layers.{layer}.k.smooth"], lam, rtol=2e-3, err_msg=f"layer {layer} lambda")
        # the mean is not trivially zero: centering has something to remove
        assert np.abs(mu).max() > 0.05 * scale.max()


def test_ppl_with_the_codebook_and_window_suffix(codebook):
    cb = str(codebook)
    p = run("ppl", "--model", MODEL, "--text", EVAL, "--ctx", 256, "--chunks", 1, "--threads", 2, "--json",
            "--cache", f"vq:{cb}:w256,vq:{cb}:w0,kivi2:w256,vq:{cb},kivi2", "--kl-base", "fp16")
    whole, coded, kivi, vq_default, kivi_default = json.loads(p.stdout)["results"]
    # window >= chunk: every token stays in fp16 as the fp16 cache holds it; only the summation
    # order of the attention kernels differs (float rounding)
    for r in (whole, kivi):
        assert r["ppl"] == pytest.approx(r["ppl_base"], rel=1e-3)
        assert r["kl_mean"] < 1e-5 and r["top1_agree"] > 0.99
    # the default window (128) codes the first 128 tokens of the 256: N was not ignored
    for r in (vq_default, kivi_default):
        assert r["kl_mean"] > 1e-3 and r["kv_bytes"] < whole["kv_bytes"]
    # window 0: every token is coded; quality drops but stays that of a working model
    assert coded["kl_mean"] > 1e-2 and coded["ppl"] > 1.01 * whole["ppl"]
    assert coded["ppl"] < 4 * coded["ppl_base"] and coded["top1_agree"] > 0.3
    assert coded["kv_bytes"] < 0.5 * whole["kv_bytes"]
    bad = run("ppl", "--model", MODEL, "--text", EVAL, "--ctx", 64, "--chunks", 1, "--cache", "fp16:w8", check=False)
    assert bad.returncode != 0 and "fp16:w8" in bad.stderr and "vq and kivi" in bad.stderr, bad.stderr
    for spec in ("kivi2:w", "kivi2:w99999999"):
        bad = run("ppl", "--model", MODEL, "--text", EVAL, "--ctx", 64, "--chunks", 1, "--cache", spec, check=False)
        assert bad.returncode != 0 and "expected :wN" in bad.stderr, bad.stderr


def test_keys_layers_gives_layers_their_own_key_M(codebook, tmp_path):
    """--keys-layers d2b8:0-1: layers 0 and 1 get 4-bit keys (M = 32) recorded as k.M.{i} with key
    tensors of that shape; the VQ cache then holds more key bytes than the uniform d4b8 codebook's."""
    out = tmp_path / "cb_mix.safetensors"
    run("calibrate", "--model", MODEL, "--text", CALIB, "--tokens", TOKENS, "--ctx", CTX, "--keys", "d4b8",
        "--keys-layers", "d2b8:0-1", "--iters", 2, "--threads", 2, "-o", out)
    from safetensors import safe_open

    with safe_open(str(out), framework="numpy") as f:
        meta = f.metadata()
    assert meta["k.M"] == "16" and meta["k.M.0"] == "32" and meta["k.M.1"] == "32" and "k.M.2" not in meta
    assert meta["keys_layers"] == "d2b8:0-1"
    t = st_numpy.load_file(str(out))
    assert t["layers.0.k.codebook"].shape == (256, 2) and t["layers.1.k.codebook"].shape == (256, 2)
    assert t["layers.2.k.codebook"].shape == (256, 4)
    p = run("ppl", "--model", MODEL, "--text", EVAL, "--ctx", 256, "--chunks", 1, "--threads", 2, "--json",
            "--cache", f"vq:{codebook}:w0,vq:{out}:w0")
    uni, mix = json.loads(p.stdout)["results"]
    # 256 coded tokens x 3 KV heads x 16 more key bytes in 2 layers, less 2 x 256 x 2 codebook floats
    assert mix["kv_bytes"] - uni["kv_bytes"] == 2 * 256 * 3 * 16 - 2 * 256 * 2 * 4
    for spec, msg in (("d8b12:0-1", "nbits=12"), ("d2b8:0-30", "out of the model's 0-29"), ("d2b8", "CFG:A-B"),
                      ("d2b8:3-1", "layers 3-1"), ("d2b8:0-1,", "ends with ','")):
        bad = run("calibrate", "--model", MODEL, "--text", CALIB, "--tokens", TOKENS, "--ctx", CTX,
                  "--keys-layers", spec, "-o", tmp_path / "bad.safetensors", check=False)
        assert bad.returncode == 2 and msg in bad.stderr, (spec, bad.stderr)
        assert not (tmp_path / "bad.safetensors").exists()


def test_also_writes_the_same_codebooks_as_separate_runs(tmp_path):
    """--also trains more codebooks from the one forward pass: each file equals, tensor for tensor
    and bit for bit, the file of a separate `kvpq calibrate` with the same options; the job's
    --values follows its own --keys, --keys-layers is not inherited, forward options are refused."""
    base = ["calibrate", "--model", MODEL, "--text", CALIB, "--tokens", TOKENS, "--ctx", CTX, "--iters", 2,
            "--threads", 2]
    a, b, c = tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path / "c.safetensors"
    run(*base, "--keys", "d4b8", "--keys-layers", "d2b8:3-4", "-o", a,
        "--also", f"--keys d8b8 --key-norm 0 --kmeans-init pp -o {b}")
    run(*base, "--keys", "d8b8", "--key-norm", 0, "--kmeans-init", "pp", "-o", c)
    tb, tc = st_numpy.load_file(str(b)), st_numpy.load_file(str(c))
    assert sorted(tb) == sorted(tc)
    assert all(np.array_equal(tb[k].view(np.uint32), tc[k].view(np.uint32)) for k in tb)
    assert tb["layers.3.k.codebook"].shape == (256, 8) and tb["layers.0.v.codebook"].shape == (256, 8)
    from safetensors import safe_open
    with safe_open(str(b), framework="numpy") as f:
        meta = f.metadata()
    assert meta["k.norm"] == "0" and meta["v.norm"] == "1" and meta["kmeans_init"] == "pp"
    assert st_numpy.load_file(str(a))["layers.3.k.codebook"].shape == (256, 2)
    for extra, msg in (("--ctx 64 -o x.safetensors", "--ctx belongs to the main command"),
                       # issue 31: allocation options inside --also were accepted and ignored (a plain d4b8 book)
                       ("--bits 3 -o x.safetensors", "another budget from the same measurements is --bits-also"),
                       ("--candidates d2b8 -o x.safetensors", "--candidates belongs to the main command"),
                       ("--window 0 -o x.safetensors", "--window belongs to the main command"),
                       ("--keys d8b8", "needs -o OUT"),
                       (f"--keys d8b8 -o {tmp_path / 'm.safetensors'}", "another codebook of this command writes too")):
        bad = run(*base, "-o", tmp_path / "m.safetensors", "--also", extra, check=False)
        assert bad.returncode == 2 and msg in bad.stderr, (extra, bad.stderr)
        assert not (tmp_path / "m.safetensors").exists()


def _save(cb, path):
    cb.save(path)
    return path


def test_python_calibrate_writes_the_clis_tensors(codebook, tmp_path):
    """kvpq.calibrate over the keys and values the library's own forward pass produced (the same
    tokens and chunks as `kvpq calibrate`) trains, bit for bit, the CLI's tensors: both call
    kvpq_codebook_calibrate_layer with the same defaults (d4b8, norm-explicit, centering, 25 -> 2
    k-means iterations, random init, seed 1234)."""
    import kvpq
    m = kvpq.Model(MODEL, n_threads=2)
    toks = m.tokenize(CALIB.read_text(encoding="utf-8")[:20000])[:TOKENS]
    c = m.new_cache("fp32", CTX)
    ks, vs = [[] for _ in range(m.info["n_layer"])], [[] for _ in range(m.info["n_layer"])]
    qa = np.zeros((m.info["n_layer"], m.info["n_head_kv"], m.info["head_dim"]), np.float32)
    for c0 in range(0, TOKENS, CTX):
        c.truncate(0)
        m.eval(c, toks[c0:c0 + CTX], query_absmax=qa)
        for layer in range(m.info["n_layer"]):
            k, v = c.read(layer)
            ks[layer].append(k)
            vs[layer].append(v)
    kv = [(np.concatenate(ks[i]), np.concatenate(vs[i])) for i in range(m.info["n_layer"])]
    cb = kvpq.calibrate(kv, keys="d4b8", niter=2, n_threads=2, query_absmax=qa)
    out = tmp_path / "py.safetensors"
    cb.save(out)
    ours, cli = st_numpy.load_file(str(out)), st_numpy.load_file(str(codebook))
    assert sorted(ours) == sorted(cli)
    for name in cli:
        assert np.array_equal(ours[name].view(np.uint32), cli[name].view(np.uint32)), name
    # without the queries: the keys-only factors (calibrate --smooth-query 0), not the CLI's default
    plain = st_numpy.load_file(str(_save(kvpq.calibrate(kv, keys="d4b8", niter=1, n_threads=2), tmp_path / "p.st")))
    k0 = np.concatenate([kv[0][0]]).astype(np.float64)
    want = np.maximum(np.sqrt(np.abs(k0 - plain["layers.0.k.mean"]).max(0)), 1e-2)
    np.testing.assert_allclose(plain["layers.0.k.smooth"], want, rtol=1e-6)
    assert not np.allclose(plain["layers.0.k.smooth"], cli["layers.0.k.smooth"], rtol=1e-2)
    # a NaN in the activations is refused, naming the layer's argument
    kv[3] = (kv[3][0].copy(), kv[3][1])
    kv[3][0][5, 1, 7] = np.nan
    with pytest.raises(kvpq.Error, match=r"k \(layer 3\): holds NaN or Inf \(first at index \(5, 1, 7\)\)"):
        kvpq.calibrate(kv, keys="d4b8", niter=1)


def test_head_granularity_and_second_key_stage_from_the_cli(tmp_path):
    """--granularity head --keys d8b8 --keys2 d8b8 (and --values-layers): one (n_head_kv, ksub, dsub)
    book per KV head, a k.codebook2 per layer trained on the stage-one residuals of unit directions
    (so its centroids are shorter than stage one's), per-layer value M; `kvpq ppl` with a window of 0
    counts the second stage's codes and centroids in the cache's bytes, exactly."""
    base = ["calibrate", "--model", MODEL, "--text", CALIB, "--tokens", TOKENS, "--ctx", CTX, "--iters", 2,
            "--threads", 2, "--granularity", "head", "--keys", "d8b8", "--values", "d4b8"]
    one, two = tmp_path / "h1.safetensors", tmp_path / "h2.safetensors"
    run(*base, "-o", one, "--also", f"--keys2 d8b8 --values-layers d8b8:0-1 -o {two}")
    from safetensors import safe_open
    with safe_open(str(two), framework="numpy") as f:
        meta = f.metadata()
    assert meta["kvpq.format_version"] == "4" and meta["k.granularity"] == "head" and meta["k.stages"] == "2"
    assert meta["k2.M"] == "8" and meta["v.M.0"] == "8" and meta["v.M.1"] == "8" and "v.M.2" not in meta
    t, t1 = st_numpy.load_file(str(two)), st_numpy.load_file(str(one))
    assert t["layers.5.k.codebook"].shape == (3, 256, 8) and t["layers.5.k.codebook2"].shape == (3, 256, 8)
    assert t["layers.0.v.codebook"].shape == (3, 256, 8) and t["layers.2.v.codebook"].shape == (3, 256, 4)
    assert "layers.0.k.codebook2" not in t1
    # the heads' books differ; stage two codes residuals: shorter centroids than stage one's
    k = t["layers.5.k.codebook"]
    assert not np.array_equal(k[0], k[1]) and not np.array_equal(k[1], k[2])
    for layer in (0, 13, 29):
        n1 = np.linalg.norm(t[f"layers.{layer}.k.codebook"], axis=-1).mean()
        n2 = np.linalg.norm(t[f"layers.{layer}.k.codebook2"], axis=-1).mean()
        assert n2 < 0.8 * n1, (layer, n1, n2)
    info = subprocess.run([BIN, "info", str(two)], capture_output=True, text=True)
    assert info.returncode == 0 and "granularity=head" in info.stdout and "key2" in info.stdout, info.stdout
    p = run("ppl", "--model", MODEL, "--text", EVAL, "--ctx", 256, "--chunks", 1, "--threads", 2, "--json",
            "--cache", f"vq:{one}:w0,vq:{two}:w0")
    r1, r2 = json.loads(p.stdout)["results"]
    # 256 coded tokens x 3 KV heads x (30 layers x 8 stage-two bytes, less 8 value bytes in the 2 d8b8
    # value layers), plus the stage-two books (30 x 3 x 256 x 8 floats) and the 2 larger value books
    # (3 x 256 x (8 - 4) floats more each)
    want = 256 * 3 * (30 * 8 - 2 * 8) + 30 * 3 * 256 * 8 * 4 + 2 * 3 * 256 * 4 * 4
    assert r2["kv_bytes"] - r1["kv_bytes"] == want
    assert np.isfinite(r2["ppl"]) and r2["ppl"] > 1
    bad = run("calibrate", "--model", MODEL, "--text", CALIB, "--tokens", TOKENS, "--ctx", CTX, "--keys", "d4b8",
              "--keys2", "d8b12", "-o", tmp_path / "bad.safetensors", check=False)
    assert bad.returncode == 2 and "--keys2 d8b12 has nbits=12" in bad.stderr, bad.stderr
