"""Tokenizer throughput: kvpq (kvpq_vocab_tokenize through the kvpq package) beside HF tokenizers (the same
vocabulary, merges and SmolLM2 pre-tokenizer, built by tests/python/test_tokenizer_peer.py), both run
in this one process on the same text, single-threaded, median of repeats.

    KVPQ_LIB=build/libkvpq.so python3 bench/bench_tokenizer.py [text.txt ...] [--repeat N]
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))
os.environ.setdefault("RAYON_NUM_THREADS", "1")  # HF tokenizers: one thread, like kvpq
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
import test_tokenizer_peer as peer  # noqa: E402


def median_time(fn, repeat):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("texts", nargs="*", default=[str(ROOT / "data" / "text" / "emma.txt")])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--model", default=str(peer.MODEL))
    a = ap.parse_args()
    os.environ.setdefault("KVPQ_LIB", str(ROOT / "build" / "libkvpq.so"))
    sys.path.insert(0, str(ROOT / "python"))
    import kvpq
    h = kvpq.Vocab(a.model)
    t0 = time.perf_counter()
    tk = peer.hf_from_gguf(a.model)
    print(f"HF tokenizer built from the GGUF in {time.perf_counter() - t0:.2f} s")
    print(f"{'text':<22} {'bytes':>9} {'tokens':>8} {'kvpq s':>8} {'kvpq tok/s':>11} {'HF s':>8} {'HF tok/s':>11}"
          f" {'speedup':>8} {'same ids':>8}")
    for path in a.texts:
        text = peer.read_text(path)
        data = text.encode("utf-8")
        # One kvpq call into a buffer allocated beforehand (a token is at least one byte).
        # (the raw call through kvpq.lib: Vocab.tokenize would add a sizing pass)
        buf = kvpq.ffi.new("int32_t[]", len(data) + 1)
        n = kvpq.ffi.new("size_t *")

        def run_kvpq():
            st = kvpq.lib.kvpq_vocab_tokenize(h._h, data, len(data), 0, 1, buf, len(data) + 1, n)
            assert st == 0, kvpq.last_error()

        tk_s, _ = median_time(run_kvpq, a.repeat)
        ids = list(buf[0:n[0]])
        hf_s, enc = median_time(lambda: tk.encode(text, add_special_tokens=False), a.repeat)
        n = len(ids)
        print(f"{Path(path).name:<22} {len(text.encode()):>9} {n:>8} {tk_s:>8.3f} {n / tk_s:>11.0f} {hf_s:>8.3f}"
              f" {len(enc.ids) / hf_s:>11.0f} {hf_s / tk_s:>7.1f}x {str(enc.ids == ids):>8}")


if __name__ == "__main__":
    main()
