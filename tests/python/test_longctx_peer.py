"""bench/longctx_peer.py's pure parts (argument parsing, contexts per model, the alternation of rounds,
medians and ratios, the result JSON's shape, the figure) without the peers, and one tiny real run per
engine that is built here (kvpq at ctx 32; llama.cpp's libllama and quant.cpp's library where
scripts/build_llama_peer.sh / build_quantcpp_peer.sh left them; skipped otherwise). A few seconds."""
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

SRC = Path(os.environ.get("KVPQ_SOURCE_DIR", Path(__file__).resolve().parents[2]))
BIN = os.path.abspath(os.environ.get("KVPQ_BIN", str(SRC / "build" / "kvpq")))
sys.path.insert(0, str(SRC / "bench"))
import longctx_peer as lp  # noqa: E402

MODEL = SRC / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = SRC / "data" / "text" / "persuasion.txt"


def test_parse_caches():
    assert lp.parse_caches("kvpq:fp16, kvpq:b2.5,llama:q4_0,qcpp:turbo_kv_4b") == [
        ("kvpq", "fp16"), ("kvpq", "b2.5"), ("llama", "q4_0"), ("qcpp", "turbo_kv_4b")]
    assert [lab for lab in map(lambda r: lp.label(*r), lp.parse_caches(lp.DEFAULT_CACHES))] == [
        "kvpq:fp16", "kvpq:b2.5", "kvpq:b3.0", "llama:f16", "llama:q8_0", "llama:q4_0", "qcpp:uniform_4b",
        "qcpp:turbo_kv_4b"]
    for bad in ("llama:q5_1", "kvpq:vq", "foo:fp16", "", "kvpq:fp16,kvpq:fp16"):
        with pytest.raises(ValueError):
            lp.parse_caches(bad)


def test_parse_ctx_rounds_and_contexts():
    assert lp.parse_ctx("512,4k,16K,32768") == [512, 4096, 16384, 32768]
    with pytest.raises(ValueError):
        lp.parse_ctx("4m")
    assert lp.parse_rounds_at("16k:1,32768:2") == {16384: 1, 32768: 2}
    with pytest.raises(ValueError):
        lp.parse_rounds_at("16384")
    # SmolLM2 (8192): 16k and 32k both cut to 8192 - steps, once
    assert lp.contexts_for([512, 4096, 16384, 32768], 8192, 64) == [512, 4096, 8128]
    assert lp.contexts_for([512, 32768], 32768, 64) == [512, 32704]
    a = lp.parse_args(["--ctx", "512,8k", "--rounds-at", "8k:1", "--caches", "kvpq:b2.5,llama:f16"])
    assert a.ctx == [512, 8192] and a.rounds_at == {8192: 1} and a.steps == 64 and a.threads == 2
    with pytest.raises(SystemExit):
        lp.parse_args(["--caches", "llama:q5_1"])


def test_round_order_alternates():
    runs = [("kvpq", "fp16"), ("llama", "f16"), ("qcpp", "uniform_4b")]
    assert lp.round_order(runs, 0) == runs
    assert lp.round_order(runs, 1) == runs[::-1]
    assert lp.round_order(runs, 2) == runs


def row(dec, pre, kv=1000, rss=2**20):
    return {"prompt_tok_per_s": pre, "decode_tok_per_s": dec, "decode_ms_median": 1e3 / dec, "decode_ms_mean": 1e3 / dec,
            "peak_rss_bytes": rss, "kv_bytes": kv}


def test_summarize_medians_and_ratios():
    rounds = [{"kvpq:b2.5": row(30, 100, kv=150), "llama:f16": row(10, 200)},
              {"kvpq:b2.5": row(20, 90, kv=150), "llama:f16": row(10, 100)},
              {"kvpq:b2.5": row(60, 80, kv=150), "llama:f16": row(20, 100), "qcpp:uniform_4b": {"error": "no lib"}}]
    med, ratios = lp.summarize(rounds)
    assert med["kvpq:b2.5"]["decode_tok_per_s"] == 30 and med["kvpq:b2.5"]["n"] == 3
    assert med["llama:f16"]["prompt_tok_per_s"] == 100
    assert med["qcpp:uniform_4b"] == {"error": "no lib"}
    # medians of the per-round ratios (3, 2, 3) and (0.5, 0.9, 0.8), not ratios of medians
    assert ratios["llama:f16"]["decode"] == 3.0
    assert ratios["llama:f16"]["prompt"] == pytest.approx(0.8)
    assert ratios["llama:f16"]["kv_bytes"] == pytest.approx(0.15)
    assert "qcpp:uniform_4b" not in ratios and "kvpq:b2.5" not in ratios
    assert lp.median([3, 1, 2]) == 2 and lp.median([4, 1, 2, 3]) == 2.5


def test_result_json_shape(tmp_path, monkeypatch):
    """bench_model with a fake measure: the per-round order, per-round rows, medians, ratios, the JSON
    written after each round, and the figure drawn from it."""
    calls = []

    def fake(a, name, eng, cache, ctx, ids_file):
        calls.append((eng, cache, ctx))
        if eng == "qcpp":
            raise RuntimeError("no quant.cpp library")
        return row({"kvpq": 40.0, "llama": 20.0}[eng] + len(calls), 100.0, kv={"kvpq": 100, "llama": 800}[eng])

    monkeypatch.setattr(lp, "measure", fake)
    monkeypatch.setattr(lp, "available", lambda a, eng: None)
    out = tmp_path / "r.json"
    a = SimpleNamespace(ctx=[512, 16384], steps=64, rounds=2, rounds_at={8128: 1}, qcpp_max_ctx=4096,
                        json=str(out), run_info={"command": "test"})
    runs = lp.parse_caches("kvpq:b2.5,llama:f16,qcpp:uniform_4b")
    results = {}
    lp.bench_model(a, "smollm2", runs, "unused.ids", results)
    assert calls[:6] == [("kvpq", "b2.5", 512), ("llama", "f16", 512), ("qcpp", "uniform_4b", 512),
                         ("qcpp", "uniform_4b", 512), ("llama", "f16", 512), ("kvpq", "b2.5", 512)]
    assert calls[6:] == [("kvpq", "b2.5", 8128), ("llama", "f16", 8128)]  # one round; quant.cpp over its max
    d = json.loads(out.read_text())
    assert d["schema"] == "kvpq.longctx_peer/1" and d["_run"] == {"command": "test"}
    c = d["smollm2"]["contexts"]
    assert sorted(c) == ["512", "8128"]
    assert len(c["512"]["rounds"]) == 2 and c["512"]["rounds"][1]["order"][0] == "qcpp:uniform_4b"
    assert c["512"]["rounds"][0]["runs"]["qcpp:uniform_4b"] == {"error": "no quant.cpp library"}
    assert c["512"]["median"]["kvpq:b2.5"]["decode_tok_per_s"] == 43.5  # rounds: 41 and 46
    assert c["512"]["ratios"]["llama:f16"]["decode"] == pytest.approx((41 / 22 + 46 / 25) / 2)
    assert c["512"]["ratios"]["llama:f16"]["kv_bytes"] == 0.125
    assert c["8128"]["skipped_over_qcpp_max_ctx"] == ["qcpp:uniform_4b"]
    t = lp.table([str(out)]).splitlines()
    assert len(t) == 2 + 3 + 2 and "| smollm2 | 512 | llama:f16 | 2 | 23.50 | 100.0 | 1 | 0.00 |" in t[3]
    assert t[4].startswith("| smollm2 | 512 | qcpp:uniform_4b | - | skipped: no quant.cpp library")
    pytest.importorskip("matplotlib")
    png = tmp_path / "f.png"
    lp.plot(str(png), [str(out)])
    assert png.read_bytes()[:4] == b"\x89PNG"


need_model = pytest.mark.skipif(not MODEL.exists() or not TEXT.exists() or not os.path.exists(BIN),
                                reason="no build/kvpq, SmolLM2 model or text here")


def real_args(**kw):
    a = lp.parse_args(["--kvpq", BIN, "--text", str(TEXT), "--steps", "2"])
    for k, v in kw.items():
        setattr(a, k, v)
    return a


@need_model
def test_real_kvpq_run():
    r = lp.measure(real_args(), "smollm2", "kvpq", "fp16", 32, None)
    assert r["prompt_tok_per_s"] > 0 and r["decode_tok_per_s"] > 0
    # fp16 K and V of 34 positions, SmolLM2's 30 layers x 3 KV heads x 64: 2 * 2 bytes each
    assert r["kv_bytes"] == 34 * 30 * 3 * 64 * 2 * 2
    assert 20 * 2**20 < r["peak_rss_bytes"] < 2**30


def ids_file(tmp_path):
    sys.path.insert(0, str(SRC / "python"))
    kvpq = pytest.importorskip("kvpq")
    m = kvpq.Model(str(MODEL))
    ids = m.tokenize(TEXT.read_text(encoding="utf-8")[:2000], add_bos=bool(m.info["add_bos"]))
    p = tmp_path / "t.ids"
    p.write_text(" ".join(map(str, ids)))
    return str(p)


@need_model
def test_real_llama_run(tmp_path):
    a = real_args()
    if lp.available(a, "llama"):
        pytest.skip(lp.available(a, "llama"))
    r = lp.measure(a, "smollm2", "llama", "q8_0", 32, ids_file(tmp_path))
    assert r["prompt_tok_per_s"] > 0 and r["decode_tok_per_s"] > 0
    # q8_0: 34 bytes per 32 elements, 34 positions (llama_state_seq_get_size adds a small header)
    kv = 34 * 30 * 3 * 64 * 2 * 34 // 32
    assert kv <= r["kv_bytes"] < kv + 4096


@need_model
def test_real_qcpp_run(tmp_path):
    a = real_args()
    if lp.available(a, "qcpp"):
        pytest.skip(lp.available(a, "qcpp"))
    r = lp.measure(a, "smollm2", "qcpp", "uniform_4b", 32, ids_file(tmp_path))
    assert r["prompt_tok_per_s"] > 0 and r["decode_tok_per_s"] > 0 and isinstance(r["prefill_batched"], bool)
    # uniform_4b keys: one 68-byte block (4 + 64) per 64-wide head, fp16 values (128 bytes): 34 positions
    assert r["kv_bytes"] == 30 * 34 * 3 * (68 + 128)
