"""Every `--json` output has one shape (docs/json.md): {"schema": "kvpq.<command>/1", "kvpq_version",
"settings": {...}, "results": [rows]}, validated against docs/json/kvpq.<command>.schema.json with
the PyPI `jsonschema` package; row values are checked against the run's settings."""
import json
import os
import subprocess
from pathlib import Path

import pytest

jsonschema = pytest.importorskip("jsonschema", reason="the jsonschema package is not installed")

SRC = Path(os.environ.get("KVPQ_SOURCE_DIR", Path(__file__).resolve().parents[2]))
BIN = os.environ.get("KVPQ_BIN", str(SRC / "build" / "kvpq"))
MODEL = SRC / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = SRC / "data" / "text" / "persuasion.txt"
need_model = pytest.mark.skipif(not MODEL.exists(), reason=f"model {MODEL} missing (scripts/fetch_model.sh)")


def schema(command):
    return json.loads((SRC / "docs" / "json" / f"kvpq.{command}.schema.json").read_text())


def run_json(*args):
    p = subprocess.run([BIN, *map(str, args), "--json", "--quiet"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def validate(doc, command):
    jsonschema.validate(doc, schema(command), cls=jsonschema.Draft202012Validator)
    assert doc["schema"] == f"kvpq.{command}/1"
    return doc


def test_schemas_reject_the_old_shapes():
    # the shapes before issue 15: a bare array (bench encode, ppl with several caches), {"caches": [...]}
    for command, old in (("ppl", [{"cache": "fp16", "ppl": 1.0}]), ("bench.decode", {"caches": []}),
                         ("bench.encode", [{"S": 1}])):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(old, schema(command), cls=jsonschema.Draft202012Validator)


@need_model
def test_ppl():
    doc = validate(run_json("ppl", "--model", MODEL, "--text", TEXT, "--ctx", 32, "--chunks", 2, "--cache",
                            "fp16,q8_0", "--kl-base", "fp32"), "ppl")
    assert [r["cache"] for r in doc["results"]] == ["fp16", "q8_0"]
    assert doc["settings"]["ctx"] == 32 and doc["settings"]["chunks"] == 2 and doc["settings"]["kl_base"] == "fp32"
    assert all(r["tokens"] == 2 * (32 - 1 - 16) and r["ppl"] > 1 for r in doc["results"])
    one = validate(run_json("ppl", "--model", MODEL, "--text", TEXT, "--ctx", 32, "--chunks", 1), "ppl")
    assert len(one["results"]) == 1 and one["settings"]["kl_base"] is None


@need_model
def test_bench_decode():
    doc = validate(run_json("bench", "decode", "--model", MODEL, "--text", TEXT, "--cache", "fp16,fp32",
                            "--ctx", 16, "--steps", 2, "--threads", 1), "bench.decode")
    assert [r["cache"] for r in doc["results"]] == ["fp16", "fp32"]
    assert doc["settings"]["ctx"] == 16 and doc["settings"]["steps"] == 2


def test_bench_attend():
    doc = validate(run_json("bench", "attend", "--ctx", 160, "--layers", 1, "--repeats", 1), "bench.attend")
    assert doc["settings"]["ctx"] == [160]
    rows = doc["results"]
    assert {r["ctx"] for r in rows} == {160} and len(rows) == 2 * 5  # 2 shapes x 5 caches
    for r in rows:
        assert r["us_per_call"] > 0
        fp32 = next(x for x in rows if x["model"] == r["model"] and x["cache"] == "fp32")
        assert r["speedup_vs_fp32"] == pytest.approx(fp32["us_per_call"] / r["us_per_call"])


def test_bench_encode():
    doc = validate(run_json("bench", "encode", "--shape", "64,2,64", "--repeats", 1), "bench.encode")
    assert [r["method"] for r in doc["results"]] == ["kvpq", "materializing"]
    assert all((r["S"], r["H"], r["D"], r["M"]) == (64, 2, 64, 16) for r in doc["results"])


@need_model
def test_chat():
    p = subprocess.run([BIN, "chat", "--model", str(MODEL), "-n", "6", "--temp", "0", "--cache", "q8_0", "--json",
                        "--quiet"],
                       input="Hi!\nWhat is 2+2?\n", capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    doc = validate(json.loads(p.stdout), "chat")
    assert doc["settings"]["cache"] == "q8_0" and doc["settings"]["template"] == "chatml"
    assert doc["settings"]["system"].startswith("You are a helpful AI assistant")  # SmolLM2's default
    rows = doc["results"]
    assert [r["turn"] for r in rows] == [1, 2]
    assert all(r["reply_tokens"] == len(r["reply_ids"]) <= 6 and r["prompt_tokens"] == len(r["prompt_ids"])
               for r in rows)
    empty = subprocess.run([BIN, "chat", "--model", str(MODEL), "--json", "--quiet"], input="", capture_output=True,
                           text=True, timeout=600)
    assert empty.returncode == 0 and validate(json.loads(empty.stdout), "chat")["results"] == []


@need_model
def test_calibrate(tmp_path):
    a, b, plain = tmp_path / "a.st", tmp_path / "b.st", tmp_path / "plain.st"
    doc = validate(run_json("calibrate", "--model", MODEL, "--text", TEXT, "--tokens", 256, "--ctx", 512, "--iters", 1,
                            "--bits", 3.5, "--bits-also", f"4.5 {b}", "--candidates", "d8b8,d4b8", "--holdout-ctx", 64,
                            "--window", 16, "--verify-ctx", 64, "-o", a, "--also", f"--keys d8b8 -o {plain}"),
                   "calibrate")
    rows = doc["results"]
    assert [r["file"] for r in rows] == [str(a), str(b), str(plain)]
    assert [r.get("bits") for r in rows] == [3.5, 4.5, None]
    assert all(r["effective_bits"] <= r["bits"] and r["window"] == 16 and r["sinks"] == 1 for r in rows[:2])
    assert all(0 <= r["holdout_kl"] < 1 and 0 < r["holdout_top1"] <= 1 for r in rows[:2])
    assert rows[2]["keys"] == "d8b8" and doc["settings"]["tokens"] == 256
    assert all(p.exists() for p in (a, b, plain))


@need_model
def test_info(tmp_path):
    doc = validate(run_json("info", MODEL), "info")
    r, = doc["results"]
    assert r["runs"] and r["arch"] == "llama" and r["n_layer"] == 30 and r["head_dim"] == 64
    out = tmp_path / "cb.st"
    subprocess.run([BIN, "calibrate", "--model", MODEL, "--text", TEXT, "--tokens", "128", "--ctx", "64", "--iters", "1",
                    "--quiet", "-o", out], check=True, capture_output=True, timeout=600)
    doc = validate(run_json("info", out), "info")
    r, = doc["results"]
    assert r["key_M"] == 16 and r["key_nbits"] == 8 and r["meta.keys"] == "d4b8" and r["meta.tokens"] == "128"


@need_model
def test_generate():
    doc = validate(run_json("generate", "--model", MODEL, "--prompt", "Once upon a time", "-n", 8, "--temp", 0,
                            "--cache", "kivi2:w4"), "generate")
    r, = doc["results"]
    assert r["generated"] == len(r["ids"]) == 8 and r["stop"] == "length" and r["text"]
    assert r["positions"] == r["prompt_tokens"] + 7 and doc["settings"]["cache"] == "kivi2:w4"
    p = subprocess.run([BIN, "generate", "--model", str(MODEL), "--prompt", "Once upon a time", "-n", "8", "--temp", "0",
                        "--cache", "kivi2:w4", "--print-ids", "--quiet"], capture_output=True, text=True, timeout=300)
    assert [int(t) for t in p.stdout.split()] == r["ids"]  # the same tokens as the plain run
