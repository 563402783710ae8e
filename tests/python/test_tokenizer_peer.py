"""kvpq's byte-level BPE tokenizer against HF `tokenizers` (PyPI) built from the same GGUF vocabulary.

The peer: a `tokenizers.Tokenizer` with a BPE model made from tokenizer.ggml.tokens / merges (read
with the PyPI `gguf` package, not with kvpq), SmolLM2's pre-tokenizer from its tokenizer.json
(Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False, use_regex=True)]), a
ByteLevel decoder, and the CONTROL tokens as special added tokens. kvpq must give exactly the same
ids. kvpq is reached through the kvpq package (kvpq.Vocab over the public kvpq_vocab_*).
"""
import os
import random
from pathlib import Path

import pytest

SRC = Path(os.environ.get("KVPQ_SOURCE_DIR", Path(__file__).resolve().parents[2]))
MODEL = SRC / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
QUICK = os.environ.get("KVPQ_QUICK") == "1"
N_CHARS = 20000  # characters of each novel compared (the brief's size)

# Accents, dashes, typographic quotes, emoji (with skin tone, ZWJ and flag sequences), CJK, Cyrillic,
# Arabic, digits of several scripts, contractions in both cases, CRLF, tabs, runs of spaces, and the
# whitespace characters on which regex engines disagree most (NBSP, NEL, LS, ideographic space).
UTF8_SAMPLE = (
    "Café naïve résumé façade — “quoted” ‘single’ – en dash… Ångström Œuvre ß\n"
    "Emoji: 😀 👍🏽 🇺🇸 👩‍👩‍👧 ❤️ and 你好，世界！ Россия и Українa مرحبا ١٢٣\n"
    "Numbers 12345 and 3.14159 and 1,000,000; ½ ² Ⅻ ٣ ①\n"
    "I'm sure they'll say it's fine, don't you think? We've seen it. I'D SAY IT'S OK\n"
    "tabs\tand\r\nCRLF   multiple   spaces  \n\n\n  \t x\u00a0nbsp \u0085nel\u2028ls\u3000ideo \u200bzw\n"
    "def foo(x):\n    return x ** 2  # comment\n" + " " * 300 + "end" + "!" * 300 + "\x01\x7f"
)


class Lib:
    """kvpq.Vocab in the shape these tests use: tokenize gives (status, ids) or (status, message)."""

    def __init__(self, lib_path=None):
        if lib_path:  # the library to load, when kvpq is not imported yet (else KVPQ_LIB decided)
            os.environ.setdefault("KVPQ_LIB", str(lib_path))
        import kvpq
        self.kvpq = kvpq

    def load(self, path):
        return self.kvpq.Vocab(path)

    def tokenize(self, h, text, add_bos=False, parse_special=False):
        try:
            return 0, h.tokenize(text, add_bos=add_bos, parse_special=parse_special).tolist()
        except self.kvpq.Error as e:
            return e.status, e.detail

    def piece(self, h, token):
        return h.piece(token)


def hf_from_gguf(path):
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    r = GGUFReader(str(path))

    def strings(key):
        f = r.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    tokens = strings("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ")) for m in strings("tokenizer.ggml.merges")]
    tt = r.fields["tokenizer.ggml.token_type"]
    types = [int(tt.parts[i][0]) for i in tt.data]
    assert bytes(r.fields["tokenizer.ggml.pre"].parts[r.fields["tokenizer.ggml.pre"].data[0]]).decode() == "smollm"
    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                           for i in range(len(tokens)) if types[i] == 3])
    return tk


@pytest.fixture(scope="module")
def env():
    if not MODEL.exists():
        pytest.skip(f"{MODEL} missing (scripts/fetch_model.sh)")
    pytest.importorskip("tokenizers")
    pytest.importorskip("gguf")
    lib = Lib()
    h = lib.load(MODEL)
    yield lib, h, hf_from_gguf(MODEL)


def novels():
    paths = sorted((SRC / "data" / "text").glob("*.txt"))
    shared = SRC.parent / "shared" / "data" / "text"
    if shared.is_dir():
        paths += sorted(shared.glob("*.txt"))
    return paths


def read_text(path):
    with open(path, encoding="utf-8", newline="") as f:  # keep "\r\n" as it is in the file
        return f.read()


def assert_same(lib, h, tk, text, parse_special=True):
    st, got = lib.tokenize(h, text, parse_special=parse_special)
    assert st == 0, got
    ref = tk.encode(text, add_special_tokens=False).ids
    if got != ref:
        i = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
        pytest.fail(f"first difference at token {i}: kvpq {got[max(0, i - 3):i + 5]} vs HF {ref[max(0, i - 3):i + 5]}"
                    f" around text {tk.decode(ref[max(0, i - 3):i + 5])!r}")
    return got


@pytest.mark.parametrize("path", novels(), ids=lambda p: f"{p.parent.parent.parent.name}/{p.name}")
def test_novel_prefix_matches_hf(env, path):
    lib, h, tk = env
    text = read_text(path)[:N_CHARS]
    ids = assert_same(lib, h, tk, text)
    assert len(ids) > N_CHARS // 8  # the comparison covered real text, not an empty prefix
    assert b"".join(lib.piece(h, t) for t in ids) == text.encode("utf-8")


def test_whole_novel_matches_hf(env):
    if QUICK:
        pytest.skip("KVPQ_QUICK=1")
    lib, h, tk = env
    text = read_text(SRC / "data" / "text" / "emma.txt")
    assert_same(lib, h, tk, text)


def test_utf8_sample_matches_hf(env):
    lib, h, tk = env
    ids = assert_same(lib, h, tk, UTF8_SAMPLE)
    assert b"".join(lib.piece(h, t) for t in ids) == UTF8_SAMPLE.encode("utf-8")


def test_special_tokens_match_hf(env):
    lib, h, tk = env
    text = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<|endoftext|><|im_start <file_sep>x"
    ids = assert_same(lib, h, tk, text)
    assert ids[0] == tk.token_to_id("<|im_start|>")


def test_random_strings_match_hf(env):
    """Random strings over an alphabet chosen to stress the pre-tokenizer's edge cases."""
    lib, h, tk = env
    alphabet = (list("aAzZ09 '\t\n\r.,!?-_") + ["'s", "'LL", "'re", " ", "  ", "\u00a0", "\u0085", "\u2028",
                "\u3000", "é", "ß", "Ω", "ж", "中", "😀", "👍🏽", "½", "²", "٣", "Ⅻ", "—", "…", "“", "\u200b", "\u0301"])
    rng = random.Random(1234)
    for _ in range(200 if QUICK else 2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        assert_same(lib, h, tk, text, parse_special=False)
