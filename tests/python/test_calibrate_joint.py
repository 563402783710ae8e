"""The joint check of a `kvpq calibrate --bits` allocation (docs/allocation.md): alloc.holdout_kl is
what `kvpq ppl --kl-base fp16` measures for the written file on the same tokens; --verify-ctx and
--window-select checked before any work; the auto window choice. Split from test_calibrate_bits.py so
that each ctest entry stays under two minutes."""
import json
import subprocess

import pytest

from test_calibrate_bits import _least, _meta, _ppl_on_tokens  # noqa: F401
from test_calibrate_peer import BIN, CALIB, EVAL, MODEL, run, st_numpy  # noqa: F401

pytestmark = pytest.mark.skipif(not MODEL.exists(), reason=f"model {MODEL} missing (scripts/fetch_model.sh)")


def test_joint_check_is_what_ppl_measures_for_the_written_file(tmp_path):
    """calibrate --bits checks each written file as a whole (docs/allocation.md, the joint check): its
    alloc.holdout_kl / alloc.holdout_top1 are what `kvpq ppl --kl-base fp16 --cache vq:FILE` measures
    on the same tokens (the text's tokens right after the k-means tokens), one code path: any
    difference in the cache it builds (window, sinks, presets), the tokens, the BOS or the scoring
    fails here. With --window-select auto and --window-trust 0 (any difference between predicted and
    held-out KL is too much) the next windows by predicted KL are checked (up to 2 more; here the one
    other), and the file keeps the least held-out KL. A file without the new keys (before 2026-12-02) still loads and infos."""
    out = tmp_path / "b6.safetensors"
    p = run("calibrate", "--model", MODEL, "--text", CALIB, "--tokens", 512, "--ctx", 256, "--holdout-ctx", 128,
            "--iters", 2, "--threads", 2, "--bits", 6.0, "--window-candidates", "0,16", "--candidates", "d8b8,d4b8",
            "--window-select", "auto", "--window-trust", 0, "-o", out)
    meta = _meta(out)
    assert meta["alloc.verify_ctx"] == "256" and meta["alloc.verify_start"] == "512", meta  # after the k-means tokens
    assert meta["alloc.verify_scored"] == "127" and meta["alloc.verify_base"] == "fp16", meta
    assert meta["alloc.window_select"] == "auto" and meta["alloc.window_trust"] == "0", meta
    assert "checking the next 1 window by predicted KL" in p.stderr, p.stderr
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
    assert "checking the next" not in p.stderr, p.stderr
    assert set(meta["alloc.k"].split(",")) <= {"d2b8", "d1b8"}, meta["alloc.k"]
    info = run("info", out).stdout
    assert "dsub=" in info and "joint check: " in info, info


def test_auto_rechecks_the_next_two_windows_by_prediction(tmp_path):
    """--window-select auto with a prediction off its held-out KL (--window-trust 0) and four windows
    that fit: the predicted choice and the 2 windows of next-least predicted KL are checked (3 forward
    passes, not 4), and the file keeps the least held-out KL of those."""
    out = tmp_path / "b7.safetensors"
    p = run("calibrate", "--model", MODEL, "--text", CALIB, "--tokens", 512, "--ctx", 256, "--holdout-ctx", 128,
            "--iters", 2, "--threads", 2, "--bits", 7.0, "--window-candidates", "0,8,16,32", "--candidates",
            "d8b8,d4b8", "--window-trust", 0, "-o", out)
    meta = _meta(out)
    pred = {int(w): float(kl) for w, kl in (x.split(":") for x in meta["alloc.window_predicted_kl"].split(","))}
    meas = {int(w): kl for w, kl in (x.split(":") for x in meta["alloc.window_measured_kl"].split(","))}
    meas = {w: float(kl) for w, kl in meas.items() if kl != "none"}
    assert sorted(pred) == [0, 8, 16, 32], pred  # all four fit
    assert sorted(meas) == sorted(sorted(pred, key=pred.get)[:3]), (pred, meas)
    assert "checking the next 2 windows by predicted KL" in p.stderr, p.stderr
    assert _least(meas, int(meta["alloc.window"])), (meta["alloc.window"], meas)
