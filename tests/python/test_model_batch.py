"""Model.eval_batch (kvpq_model_eval_batch) through the Python package: several sequences in one
forward pass equal each sequence's own Model.eval, bit for bit (the default 8-bit activations of
decode steps; tests/test_model_batch.c checks more kinds and models); bad input raises kvpq.Error."""
import os
from pathlib import Path

import numpy as np
import pytest

SRC = Path(os.environ.get("KVPQ_SOURCE_DIR", Path(__file__).resolve().parents[2]))
MODEL = SRC / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
kvpq = pytest.importorskip("kvpq")
pytestmark = pytest.mark.skipif(not MODEL.exists(), reason=f"model {MODEL} missing (scripts/fetch_model.sh)")

PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time, in a land far away, a"]


@pytest.fixture(scope="module")
def model():
    """The default activations (conftest.py pins KVPQ_ACT=f32 for the float32 peers; there one decode
    row alone takes the matvec kernel and a batch the matmul one: rounding, checked in C)."""
    old = os.environ.get("KVPQ_ACT")
    os.environ["KVPQ_ACT"] = "auto"
    try:
        return kvpq.Model(str(MODEL), n_threads=2)
    finally:
        if old is None:
            os.environ.pop("KVPQ_ACT")
        else:
            os.environ["KVPQ_ACT"] = old


def test_batch_equals_each_alone_and_greedy_agrees(model):
    toks = [model.tokenize(p) for p in PROMPTS]
    batched = [model.new_cache("kivi2", max_seq=64) for _ in PROMPTS]
    alone = [model.new_cache("kivi2", max_seq=64) for _ in PROMPTS]
    for step in range(8):
        lb = model.eval_batch(batched, toks)
        assert lb.shape == (len(PROMPTS), model.info["n_vocab"]) and lb.dtype == np.float32
        for i, t in enumerate(toks):
            ls = model.eval(alone[i], t)
            assert np.array_equal(lb[i], ls), f"step {step}, sequence {i}: max diff {np.abs(lb[i] - ls).max()}"
        toks = [np.array([int(row.argmax())], np.int32) for row in lb]


def test_bad_input_raises_and_leaves_caches(model):
    c = [model.new_cache("fp32", max_seq=8), model.new_cache("fp32", max_seq=8)]
    with pytest.raises(kvpq.Error, match="share one cache"):
        model.eval_batch([c[0], c[0]], [[1], [2]])
    with pytest.raises(kvpq.Error, match="sequence 1"):
        model.eval_batch(c, [[1], [model.info["n_vocab"]]])
    with pytest.raises(kvpq.Error, match="max_seq"):
        model.eval_batch(c, [[1], list(range(9))])
    with pytest.raises(kvpq.Error, match="as many caches"):
        model.eval_batch(c, [[1]])
    with pytest.raises(kvpq.Error):
        model.eval_batch([], [])
    assert c[0].seq_len(0) == 0 and c[1].seq_len(0) == 0
