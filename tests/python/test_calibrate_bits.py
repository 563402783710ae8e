"""`kvpq calibrate --bits` (docs/allocation.md) on the real model: the options of an allocation checked
before any work, the window and budget it chooses, what `kvpq ppl` then measures for the written
file, and its joint check. Split from test_calibrate_peer.py (shared helpers there) so that each
ctest entry stays under two minutes."""
import json
import subprocess

import numpy as np
import pytest

from test_calibrate_peer import BIN, CALIB, EVAL, MODEL, run, st_numpy  # noqa: F401

pytestmark = pytest.mark.skipif(not MODEL.exists(), reason=f"model {MODEL} missing (scripts/fetch_model.sh)")


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
        # held-out KL by more than 30%; then the 2 next windows by prediction (here: all 3) are checked
        # and the least held-out KL kept
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
