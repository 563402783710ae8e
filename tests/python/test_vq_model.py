"""The model run with a VQ cache equals the model run with a float32 cache that holds the VQ cache's own
reconstruction (issue #18: is Gemma-3's loss at 3 bits a defect of the coded-key path or of the budget?).

For each model present (SmolLM2-135M: GQA 9/3, head_dim 64; Gemma-3-270M: 1 KV head, head_dim 256,
sliding-window layers, per-head q/k norms), a codebook is calibrated from the model's own keys and values,
the prefix is evaluated into a VQ cache, and the next token is evaluated twice:
  - into the VQ cache (attention from codes: per-query lookup tables, norm-explicit scales, key mean);
  - into a float32 cache filled with `Cache.read` of the VQ cache after that step (what its attention
    saw: decoded codes, un-rotated, un-smoothed, plus the fp16 window), then the same token.
Both are the same computation in exact arithmetic, so KL(p_vq || p_fp32-recon) must be at float32
rounding (~1e-8), while the codes themselves perturb the model by orders of magnitude more
(KL(p_exact || p_vq)). A wrong scale, mean term or rotation in the coded path shows up as the first
KL being of the size of the second."""
import os
import sys
from pathlib import Path

import numpy as np
import pytest

SRC = Path(os.environ.get("KVPQ_SOURCE_DIR", Path(__file__).resolve().parents[2]))
TEXT = SRC / "data" / "text" / "persuasion.txt"
MODELS = {"smollm2": SRC / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf",
          "gemma3": SRC / "models" / "gemma-3-270m-Q4_K_M.gguf"}

kvpq = pytest.importorskip("kvpq")
sys.path.insert(0, str(SRC / "bench"))
from vq_model_consistency import fp32_copy, kl  # noqa: E402  (the bench's measurement, shared)


@pytest.fixture(scope="module", params=sorted(MODELS))
def setup(request):
    path = MODELS[request.param]
    if not path.exists():
        pytest.skip(f"model {path} missing (scripts/fetch_model.sh)")
    m = kvpq.Model(str(path), n_threads=2)
    toks = m.tokenize(TEXT.read_text(encoding="utf-8")[:20000], m.info["add_bos"])[:400]
    # The codebook: calibrated on the model's own keys and values of the first 256 tokens (few k-means
    # iterations: its quality is not under test, only that attention reads exactly what it codes).
    c = m.new_cache("fp32", max_seq=len(toks))
    m.eval(c, toks[:256])
    cb = kvpq.calibrate([c.read(layer) for layer in range(m.info["n_layer"])], keys="d4b8", niter=4, seed=7)
    return request.param, m, toks, cb


@pytest.mark.parametrize("n", [200, 333])
def test_vq_logits_equal_fp32_over_its_reconstruction(setup, n):
    name, m, toks, cb = setup
    ms = len(toks)
    # window 16: positions [0, floor((n + 1 - 16) / 32) * 32) are codes when the next token is attended
    vq = m.new_cache("vq", max_seq=ms, codebook=cb, window=16)
    m.eval(vq, toks[:n])
    p_vq = m.eval(vq, toks[n:n + 1])
    assert vq.stats()["tokens_coded"] >= m.info["n_layer"] * (n - 48)
    rec = fp32_copy(m, vq, n, ms)
    p_rec = m.eval(rec, toks[n:n + 1])
    exact = m.new_cache("fp32", max_seq=ms)
    m.eval(exact, toks[:n])
    p_exact = m.eval(exact, toks[n:n + 1])
    # the exact cache's copy gives the exact logits: the copy path itself loses nothing
    p_copy = m.eval(fp32_copy(m, exact, n, ms), toks[n:n + 1])
    print(f"{name} n={n}: KL(exact||copy of exact) {kl(p_exact, p_copy):.3g}")
    assert kl(p_exact, p_copy) < 1e-9
    d_codes = kl(p_exact, p_vq)
    d_path = kl(p_vq, p_rec)
    print(f"{name} n={n}: KL(exact||vq) {d_codes:.4g}, KL(vq||fp32 over its reconstruction) {d_path:.3g}")
    assert d_codes > 1e-4, f"{name}: the codes do not perturb the model (KL {d_codes:.3g}): the test is void"
    assert d_path < 1e-6, f"{name}, n {n}: attention from codes differs from its reconstruction (KL {d_path:.3g}, " \
                          f"codes' own KL {d_codes:.3g})"
    assert d_path < 1e-3 * d_codes
    assert np.abs(p_vq - p_rec).max() < 1e-2
