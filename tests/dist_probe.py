"""Run by tests/dist_check.sh with the python of a fresh venv into which kvpq was installed from an
artifact of scripts/build_wheel.sh, from outside the source tree:

    python dist_probe.py wheel|sdist OUT.npy [MODEL.gguf]

Checks that the installed package is the one imported (its libraries and headers inside the venv),
round-trips a tiny VQ cache (codes within the quantizer's error, attention from codes equal to
attention over the decoded keys and values), and, with a model, runs the forward pass (OpenBLAS)
and tokenizer (PCRE2) and saves the logits to OUT.npy for the caller to compare between installs.
For `wheel`, no OpenBLAS, PCRE2, cJSON, libgomp, libgfortran or libquadmath the process mapped may
be the system's: kvpq's are the wheel's own copies (kvpq.libs/)."""
import re
import sys
from pathlib import Path

import numpy as np

import kvpq
import kvpq._ffi as ffi_mod

BUNDLED = re.compile(r"lib(openblas|pcre2|cjson|gomp|gfortran|quadmath)")


def check_installed(site):
    for p in (ffi_mod.CORE_PATH, ffi_mod.MODEL_PATH, ffi_mod.HEADERS[0]):
        assert Path(p).resolve().is_relative_to(site), f"{p} is not from the venv's {site}"


def cache_round_trip():
    rng = np.random.default_rng(0)
    n, n_head, n_head_kv, head_dim = 256, 4, 2, 64
    k = rng.standard_normal((n, n_head_kv, head_dim)).astype(np.float32)
    v = rng.standard_normal((n, n_head_kv, head_dim)).astype(np.float32)
    cb = kvpq.calibrate([(k, v)], keys="d4b8")
    cache = kvpq.Cache("vq", 1, n_head, n_head_kv, head_dim, max_seq=n, codebook=cb, window=0)
    cache.append(0, k, v)
    k_hat, v_hat = cache.read(0)
    for name, x, x_hat in (("k", k, k_hat), ("v", v, v_hat)):
        rel = float(((x_hat - x) ** 2).sum() / (x ** 2).sum())
        # 2 bits per element on Gaussian data: well inside (0, 0.5); 0 would mean nothing was coded
        assert 0.01 < rel < 0.5, f"{name}: relative squared error {rel}"
    q = rng.standard_normal((1, n_head, head_dim)).astype(np.float32)
    out = cache.attend(0, q)[0]
    group = n_head // n_head_kv
    for h in range(n_head):
        s = k_hat[:, h // group] @ q[0, h] / np.sqrt(head_dim)
        p = np.exp(s - s.max())
        ref = (p / p.sum()) @ v_hat[:, h // group]
        assert np.allclose(out[h], ref, atol=1e-4), (h, np.abs(out[h] - ref).max())
    return rel


def model_logits(path):
    m = kvpq.Model(path)
    ids = m.tokenize("The capital of France is", add_bos=True)
    logits = m.eval(m.new_cache("fp32", max_seq=64), ids)
    assert np.isfinite(logits).all()
    return logits


def mapped_bundled_libraries():
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "/" in line}
    return sorted(p for p in paths if BUNDLED.search(Path(p).name))


def main():
    kind, out = sys.argv[1], sys.argv[2]
    site = Path(kvpq.__file__).resolve().parents[1]
    check_installed(site)
    rel = cache_round_trip()
    msg = f"{kind}: kvpq {kvpq.__version__} from {site}: vq cache round trip ok (value error {rel:.3f})"
    if len(sys.argv) > 3:
        logits = model_logits(sys.argv[3])
        np.save(out, logits)
        msg += f"; model forward ok (next token {int(logits.argmax())})"
    if kind == "wheel":
        libs = mapped_bundled_libraries()
        # (numpy's wheel brings its own libgfortran and libquadmath into numpy.libs/: also not the system's)
        system = [p for p in libs if not Path(p).resolve().is_relative_to(site)]
        ours = [Path(p).name for p in libs if Path(p).resolve().is_relative_to(site / "kvpq.libs")]
        assert not system, f"system libraries mapped: {system} (all: {libs})"
        assert len(ours) >= 2, f"the wheel's kvpq.libs/ copies were not loaded: {libs}"
        msg += f"; from kvpq.libs/: {' '.join(sorted(ours))}; no system copy mapped"
    print(msg)


if __name__ == "__main__":
    main()
