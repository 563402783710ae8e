"""Non-finite values (issue 31): a NaN or Inf weight, overflowing inputs and NaN in a saved cache's
payload are named errors with a non-zero exit code, never NaN results or token 0 with exit code 0.
The policy is written once in docs/robustness.md ("Non-finite values")."""
import os
import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest

SRC = Path(os.environ.get("KVPQ_SOURCE_DIR", Path(__file__).resolve().parents[2]))
BIN = os.environ.get("KVPQ_BIN", str(SRC / "build" / "kvpq"))
MODEL = SRC / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
need_model = pytest.mark.skipif(not MODEL.exists(), reason=f"model {MODEL} missing (scripts/fetch_model.sh)")


def run(*args, timeout=300):
    return subprocess.run([BIN, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def model_with_bad_scale(tmp_path, tensor, half):
    """A copy of the model with the first Q4_1 block scale (float16 d) of `tensor` set to `half`."""
    t = next(t for t in gguf.GGUFReader(MODEL).tensors if t.name == tensor)
    assert t.tensor_type.name == "Q4_1"
    out = tmp_path / "bad.gguf"
    shutil.copyfile(MODEL, out)
    with open(out, "r+b") as f:
        f.seek(int(t.data_offset))
        f.write(np.array([half], dtype="<u2").tobytes())
    return out


@need_model
@pytest.mark.parametrize("half,word", [(0x7E00, "NaN"), (0x7C00, "Inf")])
def test_non_finite_weight_is_a_named_error(tmp_path, half, word):
    # Before: greedy output became token 0 repeated with exit code 0, and ppl printed nan with exit 0.
    bad = model_with_bad_scale(tmp_path, "blk.29.ffn_down.weight", half)
    g = run("generate", "--model", bad, "--prompt", "Once upon a time", "-n", 4, "--temp", 0)
    assert g.returncode == 1, g.stderr
    assert "layer 29: the residual stream after the FFN" in g.stderr and " is " in g.stderr, g.stderr
    text = tmp_path / "t.txt"
    text.write_text("It was a bright cold day in April, and the clocks were striking thirteen. " * 8)
    p = run("ppl", "--model", bad, "--text", text, "--ctx", 64)
    assert p.returncode == 1 and "layer 29" in p.stderr and "nan" not in p.stdout.lower(), (p.stdout, p.stderr)
    s = run("generate", "--model", bad, "--prompt", "Once upon a time", "-n", 4, "--temp", 0.8)
    assert s.returncode == 1 and "layer 29" in s.stderr  # sampling no longer turns into greedy over NaN


@need_model
def test_finite_model_still_runs(tmp_path):
    g = run("generate", "--model", MODEL, "--prompt", "Once upon a time", "-n", 4, "--temp", 0)
    assert g.returncode == 0, g.stderr


def nonfinite_error(fn, *args, **kw):
    import kvpq
    with pytest.raises(kvpq.Error) as e:
        out = fn(*args, **kw)
        print("returned", out)  # shows what came back when no error was raised
    return str(e.value)


def test_python_extreme_finite_inputs_are_named_errors():
    # Issue 31: finite but extreme inputs came back inf/NaN without an error.
    import kvpq
    big = np.full((4, 64), 3e38, np.float32)
    assert "overflow" in nonfinite_error(kvpq.hadamard, big)
    h = kvpq.hadamard(np.full((4, 64), 1e36, np.float32))  # within FLT_MAX / sqrt(d): fine
    assert np.isfinite(h).all() and np.allclose(h[:, 0], 8e36, rtol=1e-5)
    tiny = np.full((3, 8), 1e-45, np.float32)  # subnormal: 1/|x| overflows float
    u, norms = kvpq.normalize_rows(tiny)
    assert np.isfinite(u).all() and np.allclose(u, 1 / np.sqrt(8), rtol=1e-6) and (norms > 0).all()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 8)).astype(np.float32)
    x[7] = 3e38
    assert "overflow" in nonfinite_error(kvpq.kmeans, x, 16)
    lam = np.full((2, 8), 1e-45, np.float32)
    assert "overflows float32" in nonfinite_error(kvpq.smooth_apply, np.ones((3, 2, 8), np.float32), lam)
    c = kvpq.Cache("fp32", 1, 2, 1, 64, 16)
    kv = np.full((1, 1, 64), 1e30, np.float32)
    c.append(0, kv, kv)
    msg = nonfinite_error(c.attend, 0, np.full((1, 2, 64), 1e30, np.float32))
    assert "attention of the query at position 0 is not finite" in msg
