"""The CLI against hostile files and arguments (issue 14: nothing lost, nothing injected).

Each test is the regression test of one root cause: terminal escapes from a file's strings, inputs
overwritten by -o, hangs on FIFOs and endless text, temp files left by a signal, prompt injection
through --chat, a codebook from another model. The CLI is reached through env KVPQ_BIN.
"""
import json
import os
import struct
import subprocess
from pathlib import Path

import pytest

SRC = Path(os.environ.get("KVPQ_SOURCE_DIR", Path(__file__).resolve().parents[2]))
BIN = os.environ.get("KVPQ_BIN", str(SRC / "build" / "kvpq"))
MODEL = SRC / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SEED_CB = SRC / "tests" / "fuzz" / "corpus" / "codebook" / "seed_v3_norm.safetensors"
need_model = pytest.mark.skipif(not MODEL.exists(), reason=f"model {MODEL} missing (scripts/fetch_model.sh)")


def run(*args, timeout=120, **kw):
    return subprocess.run([BIN, *map(str, args)], capture_output=True, timeout=timeout, **kw)


def read_st(path):
    b = Path(path).read_bytes()
    n = struct.unpack("<Q", b[:8])[0]
    return json.loads(b[8:8 + n]), b[8 + n:]


def write_st(path, header, data):
    h = json.dumps(header, ensure_ascii=False).encode()
    h += b" " * ((8 - (8 + len(h)) % 8) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(h)) + h + data)


def no_terminal_controls(b):
    """No C0 control but newline, no DEL, no C1 control (as UTF-8 or raw), no invalid UTF-8."""
    text = b.decode("utf-8")  # raises on invalid UTF-8
    bad = [c for c in text if (ord(c) < 0x20 and c != "\n") or 0x7f <= ord(c) <= 0x9f]
    assert not bad, f"terminal controls {bad!r} in {text!r}"


# ---- item 6: terminal injection ----

def test_info_codebook_escapes_metadata(tmp_path):
    h, data = read_st(SEED_CB)
    h["__metadata__"]["model"] = "\x1b]0;pwned\x07\x1b[2J\u009b31mred"
    h["__metadata__"]["te\x1b[1mxt"] = "ok"
    p = tmp_path / "evil.safetensors"
    write_st(p, h, data)
    r = run("info", p)
    assert r.returncode == 0, r.stderr
    no_terminal_controls(r.stdout)
    no_terminal_controls(r.stderr)
    assert b"\\x1b]0;pwned\\x07\\x1b[2J\\xc2\\x9b31mred" in r.stdout, r.stdout
    assert b"te\\x1b[1mxt" in r.stdout


def test_error_message_escapes_file_strings(tmp_path):
    h, data = read_st(SEED_CB)
    h["layers.0.\x1b[2Jevil"] = h["layers.0.k.smooth"]
    p = tmp_path / "evil.safetensors"
    write_st(p, h, data)
    r = run("info", p)
    assert r.returncode == 1
    no_terminal_controls(r.stderr)
    assert b"unexpected tensor 'layers.0.\\x1b[2Jevil'" in r.stderr, r.stderr


# ---- item 7: hangs ----

@pytest.fixture
def fifo(tmp_path):
    p = tmp_path / "fifo"
    os.mkfifo(p)
    return p


def test_info_on_fifo_refused_without_blocking(fifo):
    r = run("info", fifo, timeout=20)
    assert r.returncode == 2
    assert b"not a regular file" in r.stderr, r.stderr


@need_model
def test_model_codebook_and_text_fifos_refused_without_blocking(fifo, tmp_path):
    r = run("generate", "--model", fifo, "-n", 1, timeout=20)
    assert r.returncode == 1 and b"not a regular file" in r.stderr, r.stderr
    r = run("generate", "--model", MODEL, "--cache", f"vq:{fifo}", "-n", 1, "--prompt", "a", timeout=60)
    assert r.returncode != 0 and b"not a regular file" in r.stderr, r.stderr
    for text in (fifo, "/dev/zero", tmp_path):
        r = run("ppl", "--model", MODEL, "--text", text, "--ctx", 64, timeout=60)
        assert r.returncode == 1 and b"not a regular file" in r.stderr, (text, r.stderr)
        r = run("calibrate", "--model", MODEL, "--text", text, "-o", tmp_path / "cb.safetensors", timeout=60)
        assert r.returncode != 0 and b"not a regular file" in r.stderr, (text, r.stderr)
    assert not (tmp_path / "cb.safetensors").exists()


@need_model
def test_text_over_the_size_limit_refused(tmp_path):
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:  # sparse: nothing is written to disk
        f.truncate(300 << 20)
    r = run("ppl", "--model", MODEL, "--text", big, "--ctx", 64, timeout=60)
    assert r.returncode == 1
    assert b"314572800 bytes, over the 256 MiB limit on text files" in r.stderr, r.stderr
