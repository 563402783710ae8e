"""kvpq's forward pass and its CLI (generate, ppl) on the real model.

Peer: an independent numpy Llama forward pass (bench/llama_cpp_peer.py, NumpyLlama) over weights
dequantized by the PyPI `gguf` package, not by kvpq. kvpq is reached through the kvpq Python
package (library at env KVPQ_LIB) and through the CLI (env KVPQ_BIN). llama.cpp itself is compared by the
benchmark bench/llama_cpp_peer.py (it needs llama-cpp-python, a long source build).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SRC = Path(os.environ.get("KVPQ_SOURCE_DIR", Path(__file__).resolve().parents[2]))
MODEL = SRC / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = SRC / "data" / "text" / "persuasion.txt"
BIN = os.environ.get("KVPQ_BIN", str(SRC / "build" / "kvpq"))
LIB = os.environ.get("KVPQ_LIB", str(SRC / "build" / "libkvpq.so"))
QUICK = os.environ.get("KVPQ_QUICK") == "1"

sys.path.insert(0, str(SRC / "bench"))
pytestmark = pytest.mark.skipif(not MODEL.exists(), reason=f"model {MODEL} missing (scripts/fetch_model.sh)")

# Logits of the same Q4_1 weights in float32 by two implementations: kvpq sums products in SIMD/BLAS
# order, numpy in BLAS order; after 30 layers differences of ~1e-4 .. 1e-3 on logits up to ~30 are
# rounding. A RoPE pairing or norm mistake gives differences of order 1..10.
LOGITS_ATOL = 2e-2


def run(*args, check=True):
    p = subprocess.run([BIN, *map(str, args)], capture_output=True, text=True, timeout=900)
    if check and p.returncode != 0:
        raise AssertionError(f"kvpq {' '.join(map(str, args))} failed ({p.returncode}): {p.stderr}")
    return p


def test_logits_match_independent_numpy_forward_pass():
    from llama_cpp_peer import Kvpq, NumpyLlama
    kv = Kvpq(LIB, str(MODEL), 2)
    text = TEXT.read_text(encoding="utf-8")[:4000]
    n = 12 if QUICK else 32
    toks = kv.tokenize(text, kv.info.add_bos)[:n]
    c = kv.new_cache(n)
    ours = kv.eval(c, toks, True)
    ref = NumpyLlama(str(MODEL)).forward(toks)
    diff = np.abs(ours - ref).max()
    assert diff < LOGITS_ATOL, f"max |logit diff| {diff}"
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_ppl_json_fields_and_kl_against_itself(tmp_path):
    ctx = 64
    p = run("ppl", "--model", MODEL, "--text", TEXT, "--ctx", ctx, "--chunks", 2, "--cache", "fp32,fp16",
            "--kl-base", "fp32", "--json", "--threads", 2)
    doc = json.loads(p.stdout)
    assert doc["schema"] == "kvpq.ppl/1" and doc["settings"]["kl_base"] == "fp32" and doc["settings"]["ctx"] == ctx
    res = doc["results"]
    assert isinstance(res, list) and len(res) == 2
    f32, f16 = res
    for r in res:
        for k in ("ppl", "ppl_stderr", "tokens", "kv_bytes", "tok_per_s", "ppl_base", "kl_mean", "kl_p99",
                  "top1_agree", "kv_bytes_base", "bits_per_element"):
            assert k in r, k
        assert r["tokens"] == 2 * (ctx - 1 - ctx // 2)
    # the same cache kind as the base gives the same logits: KL 0, every top-1 the same
    assert f32["ppl"] == pytest.approx(f32["ppl_base"], rel=1e-12)
    assert f32["kl_mean"] == 0 and f32["top1_agree"] == 1
    # fp16 is close but not identical, and holds half the bytes
    assert 0 < f16["kl_mean"] < 1e-3
    assert f16["ppl"] == pytest.approx(f32["ppl"], rel=1e-2)
    assert f16["kv_bytes"] < 0.6 * f32["kv_bytes"]
    # one cache -> the same shape (one row), same ppl as in the multi-cache run
    one = json.loads(run("ppl", "--model", MODEL, "--text", TEXT, "--ctx", ctx, "--chunks", 2, "--json").stdout)
    assert one["schema"] == "kvpq.ppl/1" and len(one["results"]) == 1
    assert one["results"][0]["ppl"] == pytest.approx(f32["ppl"], rel=1e-9)


def test_ppl_rejects_non_utf8_text_and_too_long_context(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"It was a truth universally acknowledged \xff\xfe that\n" * 50)
    p = run("ppl", "--model", MODEL, "--text", bad, "--ctx", 16, check=False)
    assert p.returncode != 0 and "UTF-8" in p.stderr and "offset 40" in p.stderr, p.stderr
    p = run("ppl", "--model", MODEL, "--text", TEXT, "--ctx", 9000, check=False)
    assert p.returncode != 0 and "training context" in p.stderr, p.stderr
    p = run("ppl", "--model", MODEL, "--text", TEXT, "--cache", "fp33", check=False)
    assert p.returncode != 0 and "fp33" in p.stderr, p.stderr


def test_generate_greedy_is_deterministic_and_streams_the_prompt():
    args = ("generate", "--model", MODEL, "--prompt", "The capital of France is", "-n", 8, "--temp", 0)
    a, b = run(*args), run(*args)
    assert a.stdout == b.stdout
    assert a.stdout.startswith("The capital of France is Paris")
    assert "tok/s" in a.stderr
    # sampling with a seed is reproducible too
    s1 = run("generate", "--model", MODEL, "--prompt", "Once", "-n", 6, "--temp", 0.9, "--seed", 7).stdout
    s2 = run("generate", "--model", MODEL, "--prompt", "Once", "-n", 6, "--temp", 0.9, "--seed", 7).stdout
    assert s1 == s2


def test_generate_chat_uses_chatml():
    p = run("generate", "--model", MODEL, "--prompt", "What is the capital of France?", "-n", 12, "--temp", 0,
            "--chat")
    assert "Paris" in p.stdout, p.stdout
    assert "<|im_start|>" not in p.stdout
