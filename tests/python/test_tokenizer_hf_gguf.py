"""kvpq's tokenizers for Qwen2.5 (byte-level BPE, pre-tokenizer qwen2) and Gemma-3 (SentencePiece BPE)
against a second peer from PyPI: the `tokenizers.Tokenizer` that HF transformers builds from a GGUF
file (transformers.integrations.gguf.gguf_tokenizer_mapping, the code behind
AutoTokenizer.from_pretrained(dir, gguf_file=...)). Its metadata is read here with the PyPI `gguf`
package, because transformers' own GGUF reader imports torch.

The first peer is llama.cpp (tests/test_tokenizer_golden.c); where the two peers disagree, kvpq
follows llama.cpp, and the cases are named below and checked to be the only differences:
  - Gemma-3 stores its whitespace-run tokens (2 to 31 spaces) as USER_DEFINED with real spaces;
    llama.cpp cuts them out of the text before BPE (longest first), transformers respells them
    '▁▁...' and lets BPE merge the run: the same token for up to 31 spaces, but a longer run splits
    differently (40 spaces: 31 + 9 in llama.cpp, 16 + 24 in transformers);
  - Qwen2.5's "</s>" is a NORMAL token that llama.cpp marks CONTROL (an end-of-generation text), so
    with special tokens parsed "</s>" is one token in llama.cpp and kvpq, three in transformers.
SmolLM2's vocabulary is compared with HF tokenizers directly by test_tokenizer_peer.py.
"""
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_tokenizer_peer import Lib  # noqa: E402

SRC = Path(os.environ.get("KVPQ_SOURCE_DIR", Path(__file__).resolve().parents[2]))
QUICK = os.environ.get("KVPQ_QUICK") == "1"
N_CHARS = 20000
MODELS = {
    "qwen25": "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
    "gemma3": "gemma-3-270m-Q4_K_M.gguf",
}
NOVEL_DIRS = [SRC / "data" / "text", SRC.parent / "shared" / "data" / "text"]
NOVELS = ["emma", "mansfieldpark", "northangerabbey", "persuasion", "prideprejudice", "sensesensibility"]


def hf_from_gguf(path):
    pytest.importorskip("transformers")
    from gguf import GGUFReader
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (GGUF_TOKENIZER_MAPPING,
                                                                       convert_gguf_tokenizer)

    r = GGUFReader(str(path))
    td = {name: r.fields["tokenizer." + key].contents()
          for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items() if "tokenizer." + key in r.fields}
    tk, _ = convert_gguf_tokenizer(r.fields["general.architecture"].contents(), td)
    return tk


@pytest.fixture(scope="module", params=list(MODELS))
def pair(request):
    path = SRC / "models" / MODELS[request.param]
    if not path.exists():
        pytest.skip(f"{path} missing: run scripts/fetch_model.sh")
    lib = Lib(os.environ.get("KVPQ_LIB", str(SRC / "build" / "libkvpq.so")))
    return request.param, lib, lib.load(path), hf_from_gguf(path)


def novels():
    out = []
    for name in NOVELS:
        for d in NOVEL_DIRS:
            if (d / f"{name}.txt").exists():
                out.append((name, (d / f"{name}.txt").read_text(encoding="utf-8")))
                break
    assert len(out) >= 2, "data/text/emma.txt and persuasion.txt missing"
    return out


def test_novels_equal(pair):
    model, lib, h, tk = pair
    for name, text in novels():
        text = text[: 3000 if QUICK else N_CHARS]
        st, ids = lib.tokenize(h, text, parse_special=True)
        assert st == 0, ids
        assert ids == tk.encode(text, add_special_tokens=False).ids, f"{model} {name}"


def test_edge_sample_lines(pair):
    """Each line of the edge sample on its own: equal, except exactly the lines with a run of more
    than 31 spaces (Gemma) or with "</s>" (Qwen2.5), the documented differences."""
    model, lib, h, tk = pair
    lines = (SRC / "tests" / "data" / "tokenizer" / "edge.txt").read_text(encoding="utf-8").split("\n")
    differ = []
    for i, line in enumerate(lines):
        st, ids = lib.tokenize(h, line + "\n", parse_special=True)
        assert st == 0, ids
        if ids != tk.encode(line + "\n", add_special_tokens=False).ids:
            differ.append(i)
    expect = [i for i, line in enumerate(lines)
              if (model == "gemma3" and " " * 32 in line) or (model == "qwen25" and "</s>" in line)]
    assert differ == expect, f"{model}: lines {differ} differ, expected {expect}"
