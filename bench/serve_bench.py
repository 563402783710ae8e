"""`kvpq serve` throughput and memory (a first look; the issue-35 benchmark beside llama-server is not
done yet): for each cache SPEC, start a server, then
  - aggregate decode tok/s with 1, 2 and 4 concurrent clients (each asks for --tokens tokens, greedy,
    its own prompt, --parallel 4), from the server's own counters (/metrics: completion tokens over
    wall time of the round);
  - the resident KV bytes per conversation after --tokens-long positions (/metrics).
Usage: python3 bench/serve_bench.py [--model M] [--caches fp32,q8_0,kivi2] [--threads 2]
Needs the openai package. Prints one markdown table.
"""
import argparse
import os
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


def start(bin_, model, cache, threads):
    p = subprocess.Popen([bin_, "serve", "--model", model, "--cache", cache, "--port", "0", "--threads", threads,
                          "--parallel", "4", "--ctx", "4096"], stderr=subprocess.PIPE, text=True)
    line = p.stderr.readline()
    return p, line.split("listening on ")[1].split()[0]


def round_tok_s(url, n_clients, tokens, tag):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    before = metrics(url)["kvpq_completion_tokens_total"]

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
    return (metrics(url)["kvpq_completion_tokens_total"] - before) / dt


def resident_per_conversation(url, n_pos):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    before = metrics(url)
    text = (SRC / "data" / "text" / "persuasion.txt").read_text()[: n_pos * 4]
    client.completions.create(model="m", prompt=text, max_tokens=1, temperature=0)
    after = metrics(url)
    return after["kvpq_kv_resident_bytes"] - before["kvpq_kv_resident_bytes"], after["kvpq_prompt_tokens_total"] - before["kvpq_prompt_tokens_total"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.environ.get("KVPQ_BIN", str(SRC / "build" / "kvpq")))
    ap.add_argument("--model", default=str(SRC / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--caches", default="fp32,q8_0,kivi2")
    ap.add_argument("--threads", default="2")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--tokens-long", type=int, default=1024)
    a = ap.parse_args()
    print(f"model {Path(a.model).name}, threads {a.threads}, {a.tokens} tokens per client, greedy\n")
    print("| cache | tok/s, 1 client | 2 clients | 4 clients | resident KV bytes of one conversation (positions) |")
    print("|---|---|---|---|---|")
    for cache in a.caches.split(","):
        p, url = start(a.bin, a.model, cache, a.threads)
        try:
            rates = [round_tok_s(url, n, a.tokens, cache) for n in (1, 2, 4)]
            res, pos = resident_per_conversation(url, a.tokens_long)
        finally:
            p.terminate()
            p.wait()
        print(f"| {cache} | {rates[0]:.1f} | {rates[1]:.1f} | {rates[2]:.1f} | {res:.0f} ({pos:.0f}) |")


if __name__ == "__main__":
    main()
