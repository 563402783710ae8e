"""`kvpq bench decode`: the end-to-end decode benchmark's interface (JSON fields, one entry per
cache in the order given, speedups against the first cache, clear errors for bad input). Timings
are printed, never asserted (benchmarks, not timed tests)."""
import json
import os
import subprocess
from pathlib import Path

import pytest

SRC = Path(os.environ.get("KVPQ_SOURCE_DIR", Path(__file__).resolve().parents[2]))
MODEL = SRC / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = SRC / "data" / "text" / "persuasion.txt"
BIN = os.environ.get("KVPQ_BIN", str(SRC / "build" / "kvpq"))

pytestmark = pytest.mark.skipif(not MODEL.exists(), reason=f"model {MODEL} missing (scripts/fetch_model.sh)")


def run(*args):
    return subprocess.run([BIN, "bench", "decode", *map(str, args)], capture_output=True, text=True, timeout=600)


def test_json_has_every_cache_in_order():
    p = run("--model", MODEL, "--text", TEXT, "--ctx", 48, "--steps", 3, "--cache", "fp16,fp32,q8_0",
            "--threads", 1, "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["schema"] == "kvpq.bench.decode/1" and (r["settings"]["ctx"], r["settings"]["steps"]) == (48, 3)
    assert [c["cache"] for c in r["results"]] == ["fp16", "fp32", "q8_0"]
    first = r["results"][0]
    assert first["decode_speedup_vs_first"] == 1.0
    for c in r["results"]:
        assert c["decode_ms_median"] > 0 and c["prompt_tok_per_s"] > 0
        assert c["decode_tok_per_s"] == pytest.approx(1e3 / c["decode_ms_median"])
        assert c["decode_speedup_vs_first"] == pytest.approx(first["decode_ms_median"] / c["decode_ms_median"])


def test_table_names_each_cache():
    p = run("--model", MODEL, "--text", TEXT, "--ctx", 16, "--steps", 2, "--cache", "fp32,fp16", "--threads", 1)
    assert p.returncode == 0, p.stderr
    rows = [l.split()[0] for l in p.stdout.splitlines()[2:]]
    assert rows == ["fp32", "fp16"]


def test_bad_input_is_refused_with_a_message(tmp_path):
    p = run("--model", MODEL, "--text", TEXT, "--ctx", 16)
    assert p.returncode == 2 and "--cache" in p.stderr
    p = run("--model", MODEL, "--text", TEXT, "--ctx", 16, "--steps", 1, "--cache", "fp32,vq:/nonexistent.safetensors")
    assert p.returncode != 0 and "nonexistent" in p.stderr
    p = run("--model", MODEL, "--text", TEXT, "--ctx", 100000, "--cache", "fp32")
    assert p.returncode == 1 and "context" in p.stderr
    short = tmp_path / "short.txt"
    short.write_text("A few words only.")
    p = run("--model", MODEL, "--text", short, "--ctx", 64, "--cache", "fp32")
    assert p.returncode == 1 and "tokens" in p.stderr
    p = run("--model", MODEL, "--text", tmp_path / "missing.txt", "--cache", "fp32")
    assert p.returncode == 1 and "missing.txt" in p.stderr
