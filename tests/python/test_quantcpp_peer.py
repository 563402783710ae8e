"""bench/quantcpp_peer.py (quant.cpp's library driven with kvpq's token ids) against `kvpq ppl` on the
same ids: quant.cpp's full-precision cache must give kvpq's fp32 perplexity (both run the GGUF weights
as they are, TQ_NO_Q4=1), which checks the harness's chunking, BOS and scoring. Also: the PyPI wheel's
stubbed turbo_kv types are refused, and key bits follow the block layout (uniform_4b: 4 + 64 bytes
per 128-element block, one block per 64-wide head). Skipped without the `quantcpp` package."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("quantcpp", reason="the quantcpp package is not installed")

SRC = Path(os.environ.get("KVPQ_SOURCE_DIR", Path(__file__).resolve().parents[2]))
BIN = os.path.abspath(os.environ.get("KVPQ_BIN", str(SRC / "build" / "kvpq")))
MODEL = SRC / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = SRC / "data" / "text" / "persuasion.txt"
sys.path.insert(0, str(SRC / "bench"))
import quantcpp_peer  # noqa: E402

if not MODEL.exists() or not TEXT.exists():
    pytest.skip("models/SmolLM2-135M-Instruct.Q4_1.gguf or data/text/persuasion.txt is missing",
                allow_module_level=True)


def peer(tmp_path, *args):
    out = tmp_path / "peer.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC / "python"), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, str(SRC / "bench" / "quantcpp_peer.py"), "--model", str(MODEL), "--text",
                        str(TEXT), "--json", str(out), *args], capture_output=True, text=True, env=env)
    return r, (json.loads(out.read_text()) if r.returncode == 0 else None)


def test_base_matches_kvpq_fp32(tmp_path):
    r, d = peer(tmp_path, "--ctx", "48", "--chunks", "1", "--cache", "fp32")
    assert r.returncode == 0, r.stderr
    k = subprocess.run([BIN, "ppl", "--model", str(MODEL), "--text", str(TEXT), "--ctx", "48", "--chunks", "1",
                        "--cache", "fp32", "--json", "--threads", "1"], capture_output=True, text=True)
    assert k.returncode == 0, k.stderr
    kv = json.loads(k.stdout)["results"][0]
    q = d["results"][0]
    assert q["tokens"] == kv["tokens"] == 23
    assert abs(q["ppl"] / kv["ppl"] - 1) < 0.005, (q["ppl"], kv["ppl"])
    assert (q["key_bits"], q["value_bits"], q["bits_per_element"]) == (32.0, 32.0, 32.0)


def test_wheel_stub_refused(tmp_path):
    r, _ = peer(tmp_path, "--ctx", "8", "--cache", "turbo_kv_3b")
    assert r.returncode != 0 and "turbo_kv_3b is a stub" in r.stderr


def test_key_bits_from_layout():
    ql = quantcpp_peer.QuantLib(quantcpp_peer.default_lib())
    u4 = ql.type_id("uniform_4b")
    assert ql.key_bits(u4, 64) == (4 + 64) * 8 / 64
    assert ql.key_bits(u4, 128) == (4 + 64) * 8 / 128
    with pytest.raises(SystemExit, match="no KV type"):
        ql.type_id("nonesuch")
