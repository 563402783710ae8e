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


@pytest.mark.parametrize("cands,needle", [("0,16,16", "listed twice"), ("0,x", "expected up to 16"),
                                          ("5,-1", "expected up to 16"), ("", "expected up to 16"),
                                          (",".join(map(str, range(17))), "expected up to 16")])
def test_window_candidates_checked_before_the_model_loads(cands, needle, tmp_path):
    # a model that does not exist: the option is refused (exit code 2) before any loading or k-means
    p = run("calibrate", "--model", tmp_path / "none.gguf", "--text", tmp_path / "none.txt", "-o", tmp_path / "o.st",
            "--bits", 2, "--window-candidates", cands, check=False)
    assert p.returncode == 2 and needle in p.stderr and "--window-candidates" in p.stderr, p.stderr
    p = run("calibrate", "--model", tmp_path / "none.gguf", "--text", tmp_path / "none.txt", "-o", tmp_path / "o.st",
            "--bits", 2, "--window", 8, "--window-candidates", "0,8", check=False)
    assert p.returncode == 2 and "give one" in p.stderr, p.stderr
    # --bits takes every layer's presets from --candidates: --keys2 (and per-layer M) would be
    # dropped while the file's metadata still named them (before 2026-12-02: no error)
    for opt, val in (("--keys2", "d8b8"), ("--keys-layers", "d2b8:0-3"), ("--values-layers", "d2b8:0-3")):
        p = run("calibrate", "--model", tmp_path / "none.gguf", "--text", tmp_path / "none.txt", "-o",
                tmp_path / "o.st", "--bits", 2, opt, val, check=False)
        assert p.returncode == 2 and f"{opt} is not used" in p.stderr and "--candidates" in p.stderr, p.stderr


def _least(kls, w):
    """Window w has the least KL of kls {window: KL as the metadata prints it, 4 significant digits}:
    within that rounding of the minimum (calibrate compares the unrounded values, so two windows can
    print the same KL and the file keep either; seen on a fresh clone: {0: 0.2957, 16: 0.2957}, 16 kept)."""
    return w in kls and kls[w] <= min(kls.values()) * (1 + 1e-3)


def test_bits_chooses_the_window_and_ppl_holds_the_budget(tmp_path):
    """calibrate --bits with --window-candidates end to end on the real model: the file records every
    candidate window's predicted KL and takes the least one among those that fit; `vq:FILE` brings
    that window and the sink, and `kvpq ppl` at the allocation's context measures the effective bits
    the allocation predicted (<= the budget); a larger budget loses less; `kvpq info` shows the
    choice. Any window left out of the file, a budget overrun or a ppl run at a different window
    fails here. The candidates include a residual key candidate (d4b8+d8b8: two stages, 3 bits):
    the larger budget takes it in some layers, whose second stage the file holds and the cache
    counts (the byte model missed stage two's codes and centroids before)."""
    # at ctx 256 the 30 layers' codebooks alone are ~3.7 bits per element: budgets 5.5 and 8
    lo, hi = tmp_path / "b5.safetensors", tmp_path / "b8.safetensors"
    run("calibrate", "--model", MODEL, "--text", CALIB, "--tokens", 512, "--ctx", 256, "--holdout-ctx", 128,
        "--iters", 2, "--threads", 2, "--bits", 5.5, "--window-candidates", "0,16,64", "--candidates", "d8b8,d4b8,d4b8+d8b8", "-o", lo,
        "--bits-also", f"8.0 {hi}")
    from safetensors import safe_open
    metas = []
    for f in (lo, hi):
        with safe_open(str(f), framework="numpy") as h:
            metas.append(h.metadata())
    for meta, budget in zip(metas, (5.5, 8.0)):
        assert meta["alloc.ctx"] == "256" and meta["alloc.sinks"] == "1", meta
        # --bits defaults to 8-bit norm-explicit scales (docs/vq_cache.md); ppl's bits below count them
        assert meta["k.norm_bits"] == "8" and meta["v.norm_bits"] == "8", meta
        pred = {}
        for item in meta["alloc.window_predicted_kl"].split(","):
            w, kl = item.split(":")
            pred[int(w)] = None if kl == "none" else float(kl)
        assert sorted(pred) == [0, 16, 64], meta["alloc.window_predicted_kl"]
        fits = {w: kl for w, kl in pred.items() if kl is not None}
        assert fits, pred
        # --window-select auto (the default): the predicted choice, unless its prediction is off its
        # held-out KL by more than 30%; then every window is checked and the least held-out KL kept
        assert meta["alloc.window_select"] == "auto" and meta["alloc.window_trust"] == "0.3", meta
        best = min(fits, key=fits.get)
        if "alloc.window_measured_kl" in meta:
            meas = {int(w): kl for w, kl in (x.split(":") for x in meta["alloc.window_measured_kl"].split(","))}
            meas = {w: float(kl) for w, kl in meas.items() if kl != "none"}
            assert sorted(meas) == sorted(fits) and len(fits) > 1, (meas, fits)
            assert abs(fits[best] / meas[best] - 1) > 0.3, (fits, meas)  # the prediction was off
            assert _least(meas, int(meta["alloc.window"])), (meta["alloc.window"], meas)
            assert float(meta["alloc.holdout_kl"]) == pytest.approx(min(meas.values()), rel=1e-3)
        else:
            assert len(fits) == 1 or abs(fits[best] / float(meta["alloc.holdout_kl"]) - 1) <= 0.3, (fits, meta)
            assert _least(fits, int(meta["alloc.window"])), (meta["alloc.window"], pred)
        assert float(meta["alloc.effective_bits"]) <= budget
    assert float(metas[1]["alloc.predicted_kl"]) < float(metas[0]["alloc.predicted_kl"])
    k_hi = metas[1]["alloc.k"].split(",")
    assert "d4b8+d8b8" in k_hi and metas[1]["k.stages"] == "2", metas[1]["alloc.k"]
    assert "+" not in metas[1]["alloc.v"], metas[1]["alloc.v"]
    t_hi = st_numpy.load_file(str(hi))
    for layer, name in enumerate(k_hi):
        assert (f"layers.{layer}.k.codebook2" in t_hi) == (name == "d4b8+d8b8"), (layer, name)
    p = run("ppl", "--model", MODEL, "--text", EVAL, "--ctx", 256, "--chunks", 1, "--threads", 2, "--json",
            "--cache", f"fp16,vq:{lo},vq:{hi}")
    base, r_lo, r_hi = json.loads(p.stdout)["results"]
    for r, meta in ((r_lo, metas[0]), (r_hi, metas[1])):
        assert abs(r["bits_per_element"] - float(meta["alloc.effective_bits"])) < 1e-3, (r, meta["alloc.effective_bits"])
    assert r_lo["bits_per_element"] <= 5.5 and r_hi["bits_per_element"] <= 8.0
    assert base["ppl"] < r_hi["ppl"] < r_lo["ppl"], (base["ppl"], r_hi["ppl"], r_lo["ppl"])
    info = subprocess.run([BIN, "info", str(lo)], capture_output=True, text=True)
    assert info.returncode == 0, info.stderr
    assert f"window {metas[0]['alloc.window']}, sinks 1" in info.stdout and "window chosen among" in info.stdout, info.stdout


def test_residual_candidate_is_never_a_value_choice(tmp_path):
    """A "P1+P2" candidate is a key choice only: values have one stage (docs/allocation.md item 7).
    Its P1 here (d8b8) is lighter than the one single-stage candidate (d4b8), so budgets between the
    two lightest value allocations could only be met by taking it for values. Before 2026-12-02 its
    value cost was a finite 1e30, which the knapsack took when nothing else fit: the 6-bit file was
    written with 'd8b8+d8b8' values in 19 layers and alloc.predicted_kl 1.9e+31, and the "lightest"
    message counted those values too (5.94 bits). Now such a budget is refused, the message names
    the lightest allocation of single-stage values, and every file written keeps single-stage values
    and a sane prediction."""
    budgets = (0.5, 5.8, 6.0, 6.2, 6.5, 7.0, 8.0)
    outs = {b: tmp_path / f"b{b}.safetensors" for b in budgets}
    p = run("calibrate", "--model", MODEL, "--text", CALIB, "--tokens", 512, "--ctx", 256, "--holdout-ctx", 128,
            "--iters", 2, "--threads", 2, "--bits", budgets[0], "--window", 16, "--candidates", "d4b8,d8b8+d8b8",
            "-o", outs[budgets[0]], *[x for b in budgets[1:] for x in ("--bits-also", f"{b} {outs[b]}")], check=False)
    import re
    light = [float(x) for x in re.findall(r"the lightest needs ([0-9.]+) effective bits", p.stderr)]
    assert light and len(set(light)) == 1, p.stderr
    from safetensors import safe_open
    written = [b for b in budgets if outs[b].exists()]
    assert written and len(written) < len(budgets), (written, p.stderr)  # some fit, some do not
    for b in budgets:
        assert outs[b].exists() == (b >= light[0]), (b, light[0], p.stderr)
    for b in written:
        with safe_open(str(outs[b]), framework="numpy") as h:
            meta = h.metadata()
        assert "+" not in meta["alloc.v"], (b, meta["alloc.v"])
        assert float(meta["alloc.predicted_kl"]) < 10, (b, meta["alloc.predicted_kl"])
        assert float(meta["alloc.effective_bits"]) <= b


def _meta(path):
    from safetensors import safe_open
    with safe_open(str(path), framework="numpy") as h:
        return h.metadata()


def _ppl_on_tokens(ids, tmp_path, ctx, *specs):
    """`kvpq ppl --kl-base fp16` over exactly these token ids (one chunk): its JSON results."""
    f = tmp_path / "ids.txt"
    f.write_text(" ".join(map(str, ids)))
    p = run("ppl", "--model", MODEL, "--tokens", f, "--ctx", ctx, "--chunks", 1, "--threads", 2, "--json",
            "--kl-base", "fp16", "--cache", ",".join(specs))
    return json.loads(p.stdout)["results"]


def test_joint_check_is_what_ppl_measures_for_the_written_file(tmp_path):
    """calibrate --bits checks each written file as a whole (docs/allocation.md, the joint check): its
    alloc.holdout_kl / alloc.holdout_top1 are what `kvpq ppl --kl-base fp16 --cache vq:FILE` measures
    on the same tokens (the text's tokens right after the k-means tokens), one code path: any
    difference in the cache it builds (window, sinks, presets), the tokens, the BOS or the scoring
    fails here. With --window-select auto and --window-trust 0 (any difference between predicted and
    held-out KL is too much) every window that fits is checked, as with measured, and the file keeps
    the least held-out KL. A file without the new keys (before 2026-12-02) still loads and infos."""
    out = tmp_path / "b6.safetensors"
    p = run("calibrate", "--model", MODEL, "--text", CALIB, "--tokens", 512, "--ctx", 256, "--holdout-ctx", 128,
            "--iters", 2, "--threads", 2, "--bits", 6.0, "--window-candidates", "0,16", "--candidates", "d8b8,d4b8",
            "--window-select", "auto", "--window-trust", 0, "-o", out)
    meta = _meta(out)
    assert meta["alloc.verify_ctx"] == "256" and meta["alloc.verify_start"] == "512", meta  # after the k-means tokens
    assert meta["alloc.verify_scored"] == "127" and meta["alloc.verify_base"] == "fp16", meta
    assert meta["alloc.window_select"] == "auto" and meta["alloc.window_trust"] == "0", meta
    assert "checking every window's allocation" in p.stderr, p.stderr
    meas = {int(w): float(kl) for w, kl in (x.split(":") for x in meta["alloc.window_measured_kl"].split(","))}
    assert sorted(meas) == [0, 16], meas
    assert _least(meas, int(meta["alloc.window"])), (meta["alloc.window"], meas)
    assert float(meta["alloc.holdout_kl"]) == pytest.approx(meas[int(meta["alloc.window"])], rel=1e-3)
    import kvpq
    ids = kvpq.Vocab(str(MODEL)).tokenize(CALIB.read_text())[512:512 + 256]
    r, = _ppl_on_tokens(ids, tmp_path, 256, f"vq:{out}")
    assert float(meta["alloc.holdout_kl"]) == pytest.approx(r["kl_mean"], rel=1e-6, abs=0), (meta, r)
    assert float(meta["alloc.holdout_top1"]) == pytest.approx(r["top1_agree"], rel=1e-12), (meta, r)
    assert float(meta["alloc.holdout_ppl"]) == pytest.approx(r["ppl"], rel=1e-6)
    assert float(meta["alloc.holdout_ppl_base"]) == pytest.approx(r["ppl_base"], rel=1e-6)
    assert r["kl_mean"] > 0 and 0 < r["top1_agree"] < 1, r
    assert f"held-out KL {float(meta['alloc.holdout_kl']):.4f}" in p.stderr, p.stderr
    info = run("info", out).stdout
    assert f"held-out KL {float(meta['alloc.holdout_kl']):.6g}" in info and "joint check: " in info, info
    assert "window chosen among (window:held-out KL)" in info, info
    # the same file without the joint check's keys (as written before): loads, infos, same cache
    tensors = st_numpy.load_file(str(out))
    old = {k: v for k, v in meta.items() if not k.startswith(("alloc.holdout_kl", "alloc.holdout_top1",
                                                              "alloc.holdout_ppl", "alloc.verify_",
                                                              "alloc.window_select", "alloc.window_measured",
                                                              "alloc.window_trust"))}
    assert len(old) == len(meta) - 11, sorted(set(meta) - set(old))
    old_f = tmp_path / "old.safetensors"
    st_numpy.save_file(tensors, str(old_f), metadata=old)
    info = run("info", old_f).stdout
    assert "predicted KL" in info and "held-out KL" not in info and "joint check" not in info, info
    r_old, = _ppl_on_tokens(ids, tmp_path, 256, f"vq:{old_f}")
    assert r_old["kl_mean"] == r["kl_mean"] and r_old["bits_per_element"] == r["bits_per_element"], (r_old, r)


def test_verify_ctx_checked(tmp_path):
    """--verify-ctx / --window-select: bad values are refused with exit code 2 and a named error,
    before the model loads; a text too short for the check: with --verify-ctx given, exit 2 naming
    the counts before the forward pass; by default, a warning naming them and a file without
    alloc.holdout_kl."""
    none = ("--model", tmp_path / "none.gguf", "--text", tmp_path / "none.txt", "-o", tmp_path / "o.st")
    for args, needle in ((("--bits", 2, "--verify-ctx", -1), "--verify-ctx: expected an integer"),
                         (("--bits", 2, "--verify-ctx", "x"), "--verify-ctx: expected an integer"),
                         (("--bits", 2, "--verify-ctx", 8), "--verify-ctx 8: expected 0 (off) or at least 16"),
                         (("--bits", 2, "--norm-bits", 12), "--norm-bits 12: expected 8 or 16"),
                         (("--verify-ctx", 64), "--verify-ctx checks the allocation of --bits"),
                         (("--bits", 2, "--window-select", "best"), "--window-select 'best': expected predicted, measured or auto"),
                         (("--window-select", "measured"), "--window-select chooses the window of --bits"),
                         (("--bits", 2, "--window-select", "measured", "--verify-ctx", 0), "not with --verify-ctx 0"),
                         (("--bits", 2, "--window-trust", -0.1), "--window-trust: expected a number in [0, 100]"),
                         (("--bits", 2, "--window-select", "measured", "--window-trust", 0.1), "--window-trust is the"),
                         (("--window-trust", 0.1), "--window-trust is the tolerance"),
                         (("--bits", 2, "--verify-ctx", 0, "--window-trust", 0.1), "not used with --verify-ctx 0"),
                         (("--also", "--verify-ctx 64 -o x.st", "--bits", 2), "--verify-ctx belongs to the main")):
        p = run("calibrate", *none, *args, check=False)
        assert p.returncode == 2 and needle in p.stderr, (args, p.returncode, p.stderr)
    p = run("calibrate", "--model", MODEL, "--text", CALIB, "--ctx", 256, "--bits", 4, "--verify-ctx", 1 << 20,
            "-o", tmp_path / "o.st", check=False)
    assert p.returncode == 2 and "--verify-ctx 1048576 exceeds the model's context length" in p.stderr, p.stderr
    short = tmp_path / "short.txt"
    short.write_text(CALIB.read_text()[:3000])  # ~700 tokens: 512 for k-means, 128 held out, too few left for 256
    common = ("calibrate", "--model", MODEL, "--text", short, "--tokens", 512, "--ctx", 256, "--holdout-ctx", 128,
              "--iters", 2, "--threads", 2, "--bits", 8, "--window", 0, "--candidates", "d4b8")
    p = run(*common, "--verify-ctx", 256, "-o", tmp_path / "a.st", check=False)
    assert p.returncode == 2 and "--verify-ctx 256: the text has" in p.stderr and "512 for k-means" in p.stderr, p.stderr
    assert "forward" not in p.stderr and not (tmp_path / "a.st").exists(), p.stderr
    p = run(*common, "-o", tmp_path / "b.st")
    assert "warning: no joint check" in p.stderr and "fewer than --verify-ctx 256" in p.stderr, p.stderr
    meta = _meta(tmp_path / "b.st")
    assert "alloc.predicted_kl" in meta and "alloc.holdout_kl" not in meta, meta


def test_long_output_path_needs_no_cache_spec(tmp_path):
    """Until 2026-12-05 the joint check reopened each written file as the cache SPEC vq:PATH: (at
    most 255 bytes), so -o paths over 251 bytes were refused with --verify-ctx or --window-select
    measured and got no check by default. The library's driver checks the codebook in memory: any
    path the file system takes is fine, with no warning (here it reaches the model loading)."""
    deep = tmp_path / ("d" * 100) / ("e" * 100)  # 300 bytes and more, in names the file system takes
    deep.mkdir(parents=True)
    long_ = str(deep / ("p" * 100 + ".st"))
    assert len(long_) > 300
    none = ("--model", tmp_path / "none.gguf", "--text", tmp_path / "none.txt", "--bits", 2)
    for args in (("-o", long_, "--verify-ctx", 64), ("-o", long_, "--window-select", "measured"),
                 ("-o", tmp_path / "o.st", "--bits-also", f"3 {long_}", "--verify-ctx", 64), ("-o", long_)):
        p = run("calibrate", *none, *args, check=False)
        assert p.returncode == 1 and "loading the model" in p.stderr, (args, p.stderr)
        assert "warning" not in p.stderr and "bytes" not in p.stderr, p.stderr


def test_auto_with_one_window_checks_nothing_more(tmp_path):
    """--window-select auto with one window candidate (--window 0) and a prediction off its held-out
    KL (--window-trust 0): there is no other window to check, so calibrate neither says it checks
    every window (it did, then checked nothing) nor records alloc.window_measured_kl. The d1b8
    preset (8 bits, dsub 1) as a candidate: the file loads in kvpq info."""
    out = tmp_path / "w0.safetensors"
    p = run("calibrate", "--model", MODEL, "--text", CALIB, "--tokens", 512, "--ctx", 256, "--holdout-ctx", 128,
            "--iters", 2, "--threads", 2, "--bits", 9, "--window", 0, "--candidates", "d2b8,d1b8",
            "--window-trust", 0, "-o", out)
    meta = _meta(out)
    kl, pred = float(meta["alloc.holdout_kl"]), float(meta["alloc.predicted_kl"])
    assert kl > 0 and pred != kl, meta  # the prediction is off: with another window, auto would check it
    assert meta["alloc.window"] == "0" and "alloc.window_measured_kl" not in meta, meta
    assert "checking every window" not in p.stderr, p.stderr
    assert set(meta["alloc.k"].split(",")) <= {"d2b8", "d1b8"}, meta["alloc.k"]
    info = run("info", out).stdout
    assert "dsub=" in info and "joint check: " in info, info


def test_bits_also_output_is_checked_before_any_work(tmp_path):
    """--bits-also "B OUT": OUT is checked as -o is (issue 14), before the model loads: the same file
    as --text or --model (it was overwritten at the end of the run), or an unwritable place (the run
    failed at the end, the budgets after it lost), exits 2 naming it; so does an OUT named as -o or
    an earlier --bits-also (the later budget's file replaced the earlier one)."""
    text = tmp_path / "t.txt"
    text.write_text("x")
    none = ("calibrate", "--model", tmp_path / "none.gguf", "--text", text, "--bits", 2, "-o", tmp_path / "o.st")
    p = run(*none, "--bits-also", f"3 {text}", check=False)
    assert p.returncode == 2 and "--bits-also" in p.stderr and "is the same file as --text" in p.stderr, p.stderr
    assert text.read_text() == "x"
    p = run(*none, "--bits-also", f"3 {tmp_path}/no/such/dir/b.st", check=False)
    assert p.returncode == 2 and "cannot write there" in p.stderr, p.stderr
    for extra in (("--bits-also", f"3 {tmp_path / 'o.st'}"),
                  ("--bits-also", f"3 {tmp_path / 'b.st'}", "--bits-also", f"4 {tmp_path / 'b.st'}")):
        p = run(*none, *extra, check=False)  # one file per budget: the last one was kept, silently
        assert p.returncode == 2 and "the same output as" in p.stderr, (extra, p.stderr)
