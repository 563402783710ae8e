"""`kvpq serve` throughput and memory, kvpq servers only (the issue-35 benchmark beside llama-server
is bench/serve_peer.py): for each cache SPEC, start a server, then
  - with --clients concurrent clients (default 1, 4, 8; each asks for --tokens tokens, greedy, its
    own short prompt, --parallel 8), three figures: completion tokens over the wall time of the round
    (prompts included: ~30-40 tokens each with the template's system message); decode tok/s, the
    server's own counters (/metrics: completion tokens over kvpq_decode_seconds_total, the engine's
    time stepping decoding sequences); and the server's CPU milliseconds per completion token (user +
    system, all threads; robust to other jobs on a shared machine, which change the wall time far
    more than the work done);
  - the resident KV bytes per conversation after --tokens-long positions (/metrics).
--bin may name several servers, LABEL=PATH,LABEL=PATH (e.g. before=/tmp/base/kvpq,after=build/kvpq):
then each is started in turn, --repeats times, alternating (AB BA AB ...), and the tables give the
median of each and the ratio of each rate to the first server's, so that a loaded machine's drift
hits both alike.
Usage: python3 bench/serve_bench.py [--bin ...] [--model M] [--caches fp32,q8_0,kivi2] [--threads 2]
Needs the openai package. Prints markdown tables.
"""
import argparse
import os
import statistics
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import openai

SRC = Path(__file__).resolve().parents[1]


def metrics(url):
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    return {k: float(v) for k, v in (line.split() for line in text.splitlines() if not line.startswith("#"))}


def start(bin_, model, cache, threads, parallel):
    p = subprocess.Popen([bin_, "serve", "--model", model, "--cache", cache, "--port", "0", "--threads", threads,
                          "--parallel", str(parallel), "--ctx", "4096"], stderr=subprocess.PIPE, text=True)
    line = p.stderr.readline()
    return p, line.split("listening on ")[1].split()[0]


def cpu_seconds(pid):
    """User + system CPU seconds of a process so far (/proc/PID/stat), all its threads."""
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def round_tok_s(url, n_clients, tokens, tag, pid=None):
    """(tok/s with prompts, decode tok/s by /metrics, server CPU-ms per completion token) of a round."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    m0 = metrics(url)
    c0 = cpu_seconds(pid) if pid else 0

    def one(i):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"{tag} story number {i}:"}],
                                       max_tokens=tokens, temperature=0)

    ts = [threading.Thread(target=one, args=(i,)) for i in range(n_clients)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    m1 = metrics(url)
    n_tok = m1["kvpq_completion_tokens_total"] - m0["kvpq_completion_tokens_total"]
    dec = m1["kvpq_decode_seconds_total"] - m0["kvpq_decode_seconds_total"]
    return n_tok / dt, n_tok / dec, ((cpu_seconds(pid) - c0) * 1e3 / n_tok if pid else 0)


def resident_per_conversation(url, n_pos):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    before = metrics(url)
    text = (SRC / "data" / "text" / "persuasion.txt").read_text()[: n_pos * 4]
    client.completions.create(model="m", prompt=text, max_tokens=1, temperature=0)
    after = metrics(url)
    return after["kvpq_kv_resident_bytes"] - before["kvpq_kv_resident_bytes"], after["kvpq_prompt_tokens_total"] - before["kvpq_prompt_tokens_total"]


def run_server(bin_, a, cache, clients, rep):
    p, url = start(bin_, a.model, cache, a.threads, a.parallel)
    try:
        round_tok_s(url, 1, 4, f"warm-up {rep}")  # the model's pages mapped in
        rates = [round_tok_s(url, n, a.tokens, f"{cache} {rep} {n} clients", p.pid) for n in clients]
        res, pos = resident_per_conversation(url, a.tokens_long) if a.tokens_long > 0 else (0, 0)
    finally:
        p.terminate()
        p.wait()
    return rates, res, pos


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.environ.get("KVPQ_BIN", str(SRC / "build" / "kvpq")),
                    help="PATH, or LABEL=PATH,LABEL=PATH,... to compare servers (alternating)")
    ap.add_argument("--model", default=str(SRC / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--caches", default="fp32,q8_0,kivi2")
    ap.add_argument("--threads", default="2")
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--tokens-long", type=int, default=1024, help="0: no resident-bytes column")
    a = ap.parse_args()
    bins = [b.split("=", 1) if "=" in b else ["kvpq", b] for b in a.bin.split(",")]
    clients = [int(c) for c in a.clients.split(",")]
    print(f"model {Path(a.model).name}, threads {a.threads}, --parallel {a.parallel}, {a.tokens} tokens per client, "
          f"greedy, median of {a.repeats} (servers alternating), load average {os.getloadavg()[0]:.1f} at start\n")
    cols = " | ".join(f"{n} client{'s' if n > 1 else ''}" for n in clients)
    measures = ["tok/s, prompts included", "decode tok/s (/metrics)", "server CPU-ms per token"]
    print(f"| server | cache | measure | {cols} |")
    print("|---|---|---|" + "---|" * len(clients))
    mem = {}
    for cache in a.caches.split(","):
        got = {label: [] for label, _ in bins}
        for rep in range(a.repeats):
            order = bins if rep % 2 == 0 else bins[::-1]
            for label, path in order:
                rates, res, pos = run_server(path, a, cache, clients, rep)
                got[label].append(rates)
                mem[(label, cache)] = (res, pos)

        def med(label, k, i):
            return statistics.median(r[k][i] for r in got[label])

        for i, what in enumerate(measures):
            for label, _ in bins:
                cells = []
                for k in range(len(clients)):
                    v, b = med(label, k, i), med(bins[0][0], k, i)
                    ratio = f" = {v / b:.2f}x" if label != bins[0][0] and i < 2 else ""
                    cells.append(f"{v:.1f}{ratio}")
                print(f"| {label} | {cache} | {what} | " + " | ".join(cells) + " |", flush=True)
    if a.tokens_long > 0:
        print("\n| server | cache | resident KV bytes of one conversation (positions) |\n|---|---|---|")
        for (label, cache), (res, pos) in mem.items():
            print(f"| {label} | {cache} | {res:.0f} ({pos:.0f}) |")
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
