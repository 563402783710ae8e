"""The CLI's conventions (issue 15): `kvpq help [CMD]` and `--help` on every (sub)command exit 0 on
stdout; unknown options and commands suggest the nearest name; `kvpq version` names the SIMD level and
CUDA; `generate` reports the cache's memory; prompts shorter than the window run with every cache
kind; `bench decode` runs from any directory."""
import os
import re
import subprocess
from pathlib import Path

import pytest

SRC = Path(os.environ.get("KVPQ_SOURCE_DIR", Path(__file__).resolve().parents[2]))
BIN = os.environ.get("KVPQ_BIN", str(SRC / "build" / "kvpq"))
MODEL = SRC / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = SRC / "data" / "text" / "emma.txt"
need_model = pytest.mark.skipif(not MODEL.exists(), reason=f"model {MODEL} missing (scripts/fetch_model.sh)")

COMMANDS = [["info"], ["calibrate"], ["generate"], ["ppl"], ["bench"], ["bench", "encode"], ["bench", "attend"],
            ["bench", "decode"], ["version"], ["help"], ["chat"]]


def run(*args, cwd=None, timeout=600):
    return subprocess.run([BIN, *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=cwd)


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: "_".join(c))
def test_help_exits_0_on_stdout(cmd):
    for args in ([*cmd, "--help"], ["help", *cmd]):
        p = run(*args)
        assert p.returncode == 0, (args, p.returncode, p.stderr)
        assert p.stdout.strip(), (args, "nothing on stdout")
        assert p.stderr == "", (args, p.stderr)


def test_top_level_help():
    for args in (["help"], ["--help"], ["-h"]):
        p = run(*args)
        assert p.returncode == 0 and "usage: kvpq" in p.stdout and p.stderr == ""
    p = run()
    assert p.returncode == 2 and "usage: kvpq" in p.stderr


@pytest.mark.parametrize("args,near", [
    (["generate", "--promt", "x"], "--prompt"),
    (["generate", "--modle", "m"], "--model"),
    (["ppl", "--jsno"], "--json"),
    (["ppl", "--chunk", "2"], "--chunks"),
    (["calibrate", "--tokns", "5"], "--tokens"),
    (["bench", "decode", "--step", "3"], "--steps"),
    (["bench", "attend", "--repeat", "3"], "--repeats"),
    (["bench", "encode", "--shap", "1,1,8"], "--shape"),
    (["generat"], "generate"),
    (["bench", "decod"], "decode"),
])
def test_unknown_names_suggest_the_nearest(args, near):
    p = run(*args)
    assert p.returncode == 2, (args, p.returncode)
    assert f"did you mean '{near}'" in p.stderr, p.stderr


def test_unknown_option_far_from_any_has_no_suggestion():
    p = run("generate", "--zzzzzzzzzz", "1")
    assert p.returncode == 2 and "unknown option '--zzzzzzzzzz'" in p.stderr and "did you mean" not in p.stderr


def test_version_names_simd_and_cuda():
    p = run("version")
    assert p.returncode == 0
    lines = p.stdout.splitlines()
    assert re.fullmatch(r"kvpq \d+\.\d+\.\d+", lines[0]), lines
    assert re.fullmatch(r"simd (scalar|avx2|avx512)", lines[1]), lines
    assert re.fullmatch(r"cuda (not built|built, no device: .+|built, device found: .+)", lines[2]), lines


@pytest.fixture(scope="module")
def codebook(tmp_path_factory):
    out = tmp_path_factory.mktemp("cb") / "tiny.safetensors"
    p = run("calibrate", "--model", MODEL, "--text", TEXT, "--tokens", 64, "--ctx", 32, "--iters", 2, "-o", out)
    assert p.returncode == 0, p.stderr
    return out


@need_model
@pytest.mark.parametrize("kind", ["fp32", "fp16", "q8_0", "q4_0", "kivi2", "kivi4", "vq"])
def test_generate_short_prompt_every_kind_reports_memory(kind, codebook):
    spec = f"vq:{codebook}" if kind == "vq" else kind
    # The README's example: a 4-token prompt, far shorter than the default window (128) and pages.
    p = run("generate", "--model", MODEL, "--cache", spec, "--prompt", "Once upon a time", "-n", 4, "--temp", 0)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("Once upon a time") and len(p.stdout) > len("Once upon a time\n")
    m = re.search(r"holds (\d+) positions: stored tokens (\d+) bytes \(([0-9.]+) bits per element\); resident (\d+) "
                  r"bytes \([0-9.]+ MiB, ([0-9.]+) bits per element", p.stderr)
    assert m, p.stderr
    positions, stored, sbits, nbytes, bits = int(m[1]), int(m[2]), float(m[3]), int(m[4]), float(m[5])
    assert positions == 4 + 3  # 4 prompt tokens (BOS-less SmolLM2) + 3 evaluated generated tokens
    elements = 2 * positions * 30 * 3 * 64  # K and V, 30 layers, 3 KV heads, head_dim 64
    assert abs(bits - nbytes * 8 / elements) < 1e-2 * bits
    assert abs(sbits - stored * 8 / elements) < 1e-2 * sbits
    # the stored tokens' bits are those of the format (7 positions, all inside a vq/kivi window: fp16);
    # resident bytes add the empty rest of the pages, the window ring and the codebook
    expect = {"fp32": 32, "fp16": 16, "q8_0": 8.5, "q4_0": 4.5, "kivi2": 16, "kivi4": 16, "vq": 16}[kind]
    assert sbits == pytest.approx(expect, abs=1e-3) and stored <= nbytes


@need_model
def test_ppl_context_shorter_than_window(codebook):
    p = run("ppl", "--model", MODEL, "--text", TEXT, "--ctx", 100, "--chunks", 1, "--cache", f"vq:{codebook},kivi2")
    assert p.returncode == 0, p.stderr


@need_model
def test_bench_decode_from_another_directory(tmp_path):
    p = run("bench", "decode", "--cache", "fp16", "--ctx", 16, "--steps", 1, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "fp16" in p.stdout


PROGRESS = re.compile(r"^kvpq [a-z ]+: .*\d+/\d+ \w+ \(\d+%\), [0-9.e+]+ \w+/s, (ETA|took) [0-9hms?]+")


@need_model
@pytest.mark.parametrize("args", [
    ["ppl", "--model", MODEL, "--text", TEXT, "--ctx", 32, "--chunks", 2, "--cache", "fp16"],
    ["calibrate", "--model", MODEL, "--text", TEXT, "--tokens", 300, "--ctx", 300, "--iters", 1, "-o", "{tmp}/c.st"],
    ["bench", "decode", "--cache", "fp16", "--ctx", 520, "--steps", 2],
    ["generate", "--model", MODEL, "--prompt", "word " * 520, "-n", 1],
], ids=["ppl", "calibrate", "bench_decode", "generate"])
def test_progress_plain_lines_when_not_a_terminal_and_quiet(args, tmp_path):
    args = [str(a).replace("{tmp}", str(tmp_path)) for a in args]
    env = dict(os.environ, KVPQ_PROGRESS_SECONDS="0")  # a line per update, not every 10 s
    p = subprocess.run([BIN, *args], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr
    assert "\r" not in p.stderr, "carriage return written to a pipe"
    lines = [l for l in p.stderr.splitlines() if PROGRESS.match(l)]
    assert len(lines) >= 2, p.stderr  # at least one update and the end line
    assert any(" ETA " in l for l in lines) and " took " in lines[-1], lines
    q = subprocess.run([BIN, *args, "--quiet"], capture_output=True, text=True, timeout=600, env=env)
    assert q.returncode == 0, q.stderr
    assert not [l for l in q.stderr.splitlines() if PROGRESS.match(l)], q.stderr


@need_model
@pytest.mark.parametrize("kind", ["fp16", "q4_0", "kivi2", "vq"])
def test_prompt_cache_reuses_and_refuses(kind, codebook, tmp_path):
    spec = f"vq:{codebook}" if kind == "vq" else kind
    f = tmp_path / "prompt.kvc"
    prompt = "It was a bright cold day in April, and the clocks were striking thirteen. " * 3
    args = ["generate", "--model", MODEL, "--cache", spec, "-n", 6, "--temp", 0, "--prompt-cache", f]
    first = run(*args, "--prompt", prompt)
    assert first.returncode == 0, first.stderr
    assert "saved" in first.stderr and f.exists()
    saved = f.read_bytes()
    second = run(*args, "--prompt", prompt)
    assert second.returncode == 0, second.stderr
    m = re.search(r"prompt cache load [0-9.]+ s for (\d+) tokens, prompt eval [0-9.]+ s for (\d+) tokens", second.stderr)
    assert m and int(m[2]) == 1 and int(m[1]) > 40, second.stderr  # all but the last prompt token loaded
    assert second.stdout == first.stdout  # greedy: the same continuation from the loaded prompt
    assert f.read_bytes() == saved  # nothing new to store: the file is not rewritten
    # a longer prompt with the same start: the shared tokens are loaded, the file then holds the longer one
    third = run(*args, "--prompt", prompt + "Winston Smith")
    assert third.returncode == 0 and "saved" in third.stderr, third.stderr
    assert int(re.search(r"load [0-9.]+ s for (\d+) tokens", third.stderr)[1]) >= int(m[1])  # shared tokens
    saved = f.read_bytes()
    # another cache kind, a damaged file: refused with a named error, the file left as it was
    other = "fp32" if kind != "fp32" else "fp16"
    p = run("generate", "--model", MODEL, "--cache", other, "-n", 1, "--prompt", prompt, "--prompt-cache", f)
    assert p.returncode == 1 and "mismatch" in p.stderr and "cache kind" in p.stderr, p.stderr
    assert f.read_bytes() == saved
    # the model is identified by its contents (header fingerprint + XXH64 of the tensor data), not its
    # file name: the same file under another name is the same model; another file under the same name,
    # equal to the model but for one byte of one weight, is another model
    same = tmp_path / "renamed.gguf"
    same.symlink_to(MODEL)
    p = run("generate", "--model", same, "--cache", spec, "-n", 1, "--prompt", prompt, "--prompt-cache", f)
    assert p.returncode == 0 and "made for another model" not in p.stderr, p.stderr
    assert f.read_bytes() == saved
    (tmp_path / "other").mkdir()
    other_model = tmp_path / "other" / MODEL.name
    data = bytearray(MODEL.read_bytes())
    data[-1000] ^= 0x01  # a byte of the last tensor's data: header, name and size unchanged
    other_model.write_bytes(bytes(data))
    del data
    p = run("generate", "--model", other_model, "--cache", spec, "-n", 1, "--prompt", prompt, "--prompt-cache", f)
    assert p.returncode == 1 and "made for another model" in p.stderr and " data=" in p.stderr, p.stderr
    assert f.read_bytes() == saved
    bad = bytearray(saved)
    bad[len(bad) // 2] ^= 1
    f.write_bytes(bytes(bad))
    p = run(*args, "--prompt", prompt)
    assert p.returncode == 1 and "checksum" in p.stderr and str(f) in p.stderr, p.stderr
    assert f.read_bytes() == bytes(bad)
    f.write_bytes(saved[: len(saved) // 3])
    p = run(*args, "--prompt", prompt)
    assert p.returncode == 1 and "truncated" in p.stderr, p.stderr


@need_model
def test_prompt_cache_without_sinks_names_the_s0_suffix(tmp_path):
    """A --prompt-cache file saved without sinks (as every file before the CLI's default of 1 sink for
    kivi2/kivi4/vq/q4_0r) is refused under the default SPEC, the message names the `:s0` suffix that
    reads it, and the file is left as it was; with `:s0` it is reused."""
    f = tmp_path / "prompt.kvc"
    prompt = "It was a bright cold day in April, and the clocks were striking thirteen. " * 2
    args = ["generate", "--model", MODEL, "-n", 1, "--temp", 0, "--prompt", prompt, "--prompt-cache", f]
    first = run(*args, "--cache", "kivi2:s0")
    assert first.returncode == 0 and f.exists(), first.stderr
    saved = f.read_bytes()
    p = run(*args, "--cache", "kivi2")
    assert p.returncode == 1 and "sinks 0, this cache has 1" in p.stderr and ":s0" in p.stderr, p.stderr
    assert f.read_bytes() == saved
    p = run(*args, "--cache", "kivi2:s0")
    assert p.returncode == 0 and "prompt cache load" in p.stderr, p.stderr


@need_model
def test_vq_codebook_brings_its_window_and_sinks(codebook, tmp_path):
    """A codebook from calibrate --bits records alloc.window / alloc.sinks; vq:FILE takes them, a
    :wN / :sN suffix wins, and a value that is not a number is refused naming the key (exit 1)."""
    import kvpq
    prompt = " ".join(["word"] * 60)  # ~60 positions: past a 0-token window's first flush, inside 128

    def with_meta(name, window, sinks):
        cb = kvpq.Codebook.load(str(codebook))
        cb.set_meta("alloc.window", window)
        cb.set_meta("alloc.sinks", sinks)
        out = tmp_path / name
        cb.save(str(out))
        return out

    def bits(spec):
        p = run("generate", "--model", MODEL, "--cache", spec, "--prompt", prompt, "-n", 1, "--temp", 0)
        assert p.returncode == 0, p.stderr
        m = re.search(r"stored tokens \d+ bytes \(([0-9.]+) bits per element\); resident (\d+) bytes", p.stderr)
        assert m, p.stderr
        return float(m[1]), int(m[2])

    w0 = with_meta("w0.safetensors", 0, 0)
    coded, res0 = bits(f"vq:{w0}")
    assert coded < 16, "alloc.window 0: positions past the flush are coded"
    fp16, _ = bits(f"vq:{w0}:w128")  # the suffix wins: every position in the fp16 window
    assert fp16 == pytest.approx(16, abs=1e-3)
    _, res_s3 = bits(f"vq:{with_meta('s3.safetensors', 0, 3)}")
    assert res_s3 - res0 == 2 * 3 * 30 * 3 * 64 * 2  # 3 fp16 sinks, K and V, 30 layers, 3 KV heads, dim 64
    _, res_s0 = bits(f"vq:{with_meta('s3b.safetensors', 0, 3)}:s0")
    assert res_s0 == res0
    bad = with_meta("bad.safetensors", "abc", 0)
    p = run("generate", "--model", MODEL, "--cache", f"vq:{bad}", "--prompt", "x", "-n", 1)
    assert p.returncode == 1 and "alloc.window = 'abc' is not a number" in p.stderr, (p.returncode, p.stderr)
