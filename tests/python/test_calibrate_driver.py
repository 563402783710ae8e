"""The calibration driver lives in the library (issue 32, item 1): `kvpq calibrate` and
kvpq.calibrate(model, text, bits=...) are thin clients of kvpq_model_calibrate, so the same options
give the same file, byte for byte; and the files equal those the CLI wrote before the move (a fixture
of sha256 sums). Bad options raise kvpq.Error naming the option before any forward pass."""
import hashlib
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

import kvpq

SRC = Path(os.environ.get("KVPQ_SOURCE_DIR", Path(__file__).resolve().parents[2]))
BIN = os.path.abspath(os.environ.get("KVPQ_BIN", str(SRC / "build" / "kvpq")))
MODEL = SRC / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = SRC / "data" / "text" / "emma.txt"
FIXTURE = SRC / "tests" / "fixtures" / "calibrate_cli_d195030.sha256"
FIXTURE_AVX2 = SRC / "tests" / "fixtures" / "calibrate_cli_d195030_avx2_l1d32k.sha256"
pytestmark = pytest.mark.skipif(not MODEL.exists(), reason=f"model {MODEL} missing (scripts/fetch_model.sh)")

# Small but every path: two budgets, a second key stage among the candidates, two windows checked by
# measurement (the joint check), values allocated, and a plain --also codebook from the same pass.
FIXTURE_ARGS = ["--tokens", 512, "--ctx", 1024, "--bits", 3.3, "--bits-also", "3.6 b36.safetensors",
                "--candidates", "d8b8,d4b8,d4b8+d8b8", "--holdout-ctx", 128, "--window-candidates", "0,16",
                "--verify-ctx", 128, "--window-select", "measured", "--iters", 3, "--threads", 2,
                "-o", "b33.safetensors", "--also", "--keys d8b8 -o plain.safetensors"]
FILES = ["b33.safetensors", "b36.safetensors", "plain.safetensors"]


def l1d_bytes():
    """The L1 data cache as glibc's sysconf(_SC_LEVEL1_DCACHE_SIZE) reports it (what the kernels read); 0 if unknown."""
    r = subprocess.run(["getconf", "LEVEL1_DCACHE_SIZE"], capture_output=True, text=True)
    try:
        return int(r.stdout.strip())
    except ValueError:
        return 0


def sha(p):
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def cli_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    r = subprocess.run([BIN, "calibrate", "--model", MODEL, "--text", TEXT, *map(str, FIXTURE_ARGS)], cwd=d,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return d


def fixture_for_this_cpu():
    """The fixture made with this CPU's kernels: AVX-512 with a 48 KiB L1D, or AVX2 with a 32 KiB one
    (src/cpu/vq_avx2.c: a 32 KiB L1D takes other table kernels, another sum order); None otherwise."""
    simd, l1d = kvpq.simd_get(), l1d_bytes()
    if simd == "avx512" and l1d > 32768:
        return FIXTURE
    if simd == "avx2" and 0 < l1d <= 32768:
        return FIXTURE_AVX2
    return None


def test_cli_files_equal_those_written_before_the_move(cli_files):
    fx = fixture_for_this_cpu()
    if fx is None:
        pytest.skip(f"no fixture made with this CPU's kernels ({kvpq.simd_get()}, L1D {l1d_bytes()} bytes)")
    want = dict(reversed(line.split()) for line in fx.read_text().splitlines() if line and line[0] != "#")
    assert {f: sha(cli_files / f) for f in FILES} == want


def test_python_call_writes_the_cli_bytes(cli_files, tmp_path):
    m = kvpq.Model(MODEL, n_threads=2)
    text = TEXT.read_text(encoding="utf-8")
    report = []
    b33, b36 = kvpq.calibrate(m, text, [3.3, 3.6], tokens=512, ctx=1024, candidates="d8b8,d4b8,d4b8+d8b8",
                              holdout_ctx=128, windows=[0, 16], verify_ctx=128, window_select="measured", iters=3,
                              n_threads=2, text_name="emma.txt", report=report)
    # the plain --also codebook inherits the main command's 8-bit norms (--bits was given)
    plain = kvpq.calibrate(m, text, tokens=512, ctx=1024, keys="d8b8", iters=3, n_threads=2, text_name="emma.txt",
                           norm_bits=8)
    for cb, name in ((b33, "b33"), (b36, "b36"), (plain, "plain")):
        cb.save(tmp_path / f"{name}.safetensors")
        assert sha(tmp_path / f"{name}.safetensors") == sha(cli_files / f"{name}.safetensors"), name
    assert [r["window"] for r in report] == [int(b33.get_meta("alloc.window")), int(b36.get_meta("alloc.window"))]
    assert report[0]["effective_bits"] <= 3.3 and report[1]["effective_bits"] <= 3.6
    assert abs(report[0]["holdout_kl"] - float(b33.get_meta("alloc.holdout_kl"))) == 0


@pytest.mark.parametrize("kw, named", [
    (dict(bits=2.5, windows=[16, 16]), "listed twice"),
    (dict(bits=2.5, candidates="d4b8,d4b12"), "nbits"),
    (dict(bits=2.5, keys2="d8b8"), "--keys2"),
    (dict(keys_layers="d2b8:0-5,d8b8:3-8"), "layer 3 is already set"),
    (dict(bits=2.5, window_select="sometimes"), "window_select"),
    (dict(ctx=1 << 20), "--ctx"),
    (dict(key_rope="auto"), "needs budgets"),
    (dict(bits=2.5, key_rope="sometimes"), "key_rope"),
])
def test_bad_options_raise_naming_the_option(kw, named):
    m = kvpq.Model(MODEL, n_threads=2)
    seen = []
    with pytest.raises(kvpq.Error) as e:
        kvpq.calibrate(m, TEXT.read_text(encoding="utf-8")[:20000], tokens=256, progress=lambda *a: seen.append(a),
                       **kw)
    assert named in str(e.value)
    assert not seen, "a forward pass ran before the options were checked"


def test_progress_can_cancel():
    m = kvpq.Model(MODEL, n_threads=2)
    with pytest.raises(kvpq.Error, match="cancelled"):
        kvpq.calibrate(m, TEXT.read_text(encoding="utf-8")[:20000], tokens=256, ctx=128,
                       progress=lambda stage, done, total: stage == "forward")


def test_keys_before_rope_python_call_writes_the_cli_bytes(tmp_path):
    """Issue 30 item 3: `--key-rope 1` and kvpq.calibrate(..., key_rope=True) write the same file: the
    model's rotation (format version 5) and codebooks trained on keys turned back by their positions."""
    out = tmp_path / "cli.safetensors"
    r = subprocess.run([BIN, "calibrate", "--model", MODEL, "--text", TEXT, "--tokens", "512", "--ctx", "256",
                        "--keys", "d4b8", "--iters", "3", "--threads", "2", "--key-rope", "1", "--norm-bits", "8",
                        "-o", out], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    cb = kvpq.calibrate(kvpq.Model(MODEL, n_threads=2), TEXT.read_text(encoding="utf-8"), tokens=512, ctx=256,
                        keys="d4b8", iters=3, n_threads=2, key_rope=True, norm_bits=8, text_name="emma.txt")
    cb.save(tmp_path / "py.safetensors")
    assert sha(tmp_path / "py.safetensors") == sha(out)
    assert cb.get_meta("kvpq.format_version") == "5" and cb.info()["key_rope"] == {"dims": 64, "layout": "norm"}
    plain = kvpq.calibrate(kvpq.Model(MODEL, n_threads=2), TEXT.read_text(encoding="utf-8"), tokens=512, ctx=256,
                           keys="d4b8", iters=3, n_threads=2, norm_bits=8)
    assert plain.info()["key_rope"] is None
    assert not np.allclose(plain.key_mean(3), cb.key_mean(3)), "the key means of pre-RoPE keys differ"


def test_calibration_runs_the_float32_activations(tmp_path):
    """Calibration is a measurement: its forward pass (and sensitivities, joint check) run the float32
    activation path whatever KVPQ_ACT says. With 8-bit activations (the default of generation until
    2026-12-06 here too) the collected keys differed, and the sensitivities' rounding floor buried the
    differences between candidates (SmolLM2 `--bits 2.5` at ctx 4096: held-out KL 0.048 vs 0.032)."""
    files = []
    for act in ("auto", "f32"):
        out = tmp_path / f"{act}.safetensors"
        r = subprocess.run([BIN, "calibrate", "--model", MODEL, "--text", TEXT, "--tokens", "512", "--ctx", "1024",
                            "--keys", "d8b8", "--iters", "1", "--threads", "2", "-o", out],
                           capture_output=True, text=True, timeout=600, env={**os.environ, "KVPQ_ACT": act})
        assert r.returncode == 0, r.stderr
        files.append(sha(out))
    assert files[0] == files[1]


def test_holdout_repeat_python_call_writes_the_cli_bytes(tmp_path):
    """`--holdout-repeat 3` and kvpq.calibrate(..., holdout_repeat=3) write the same file, and the
    file records the repeated chunk's weight (metadata `alloc.holdout_repeat`); without it, no such key;
    a weight outside 0..16 or not a whole number is a kvpq.Error naming holdout_repeat."""
    args = dict(tokens=512, ctx=1024, candidates="d8b8,d4b8", holdout_ctx=128, windows=[16], iters=2, n_threads=2)
    out = tmp_path / "cli.safetensors"
    r = subprocess.run([BIN, "calibrate", "--model", MODEL, "--text", TEXT, "--tokens", "512", "--ctx", "1024",
                        "--bits", "3.6", "--candidates", "d8b8,d4b8", "--holdout-ctx", "128", "--window-candidates",
                        "16", "--iters", "2", "--threads", "2", "--holdout-repeat", "3", "-o", out],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    m, text = kvpq.Model(MODEL, n_threads=2), TEXT.read_text(encoding="utf-8")
    cb = kvpq.calibrate(m, text, 3.6, holdout_repeat=3, text_name="emma.txt", **args)
    cb.save(tmp_path / "py.safetensors")
    assert sha(tmp_path / "py.safetensors") == sha(out)
    assert cb.get_meta("alloc.holdout_repeat") == "3"
    plain = kvpq.calibrate(m, text, 3.6, text_name="emma.txt", **args)
    assert plain.get_meta("alloc.holdout_repeat") is None
    for bad in (17, -1, 2.5):
        with pytest.raises(kvpq.Error, match="holdout_repeat"):
            kvpq.calibrate(m, text, 3.6, holdout_repeat=bad, **args)
