"""`kvpq serve` (issue 35) against a started server, with the real `openai` client (PyPI):

- chat (non-streaming and streaming) and completions; greedy replies (temperature 0) equal the CLI's
  for the same conversation and cache: `kvpq chat --temp 0 --json` (its reply per turn, the cache kept
  across turns) and `kvpq generate --temp 0` (a plain prompt);
- a conversation that continues reuses its cached prefix (usage.prompt_tokens_details.cached_tokens);
- concurrent clients (threads) each get the reply a sequential request gets;
- an evicted conversation (--kv-budget of 1 byte: every idle conversation is saved to --cache-dir) is
  loaded back and continues exactly as the uninterrupted one (the CLI's); after SIGTERM (exit 0) a new
  server finds it in --cache-dir;
- bad requests get the documented status and an OpenAI error object, and the server stays up;
- --api-key refuses a wrong key (401).
"""
import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

SRC = Path(os.environ.get("KVPQ_SOURCE_DIR", Path(__file__).resolve().parents[2]))
BIN = os.environ.get("KVPQ_BIN", str(SRC / "build" / "kvpq"))
MODEL = SRC / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
pytestmark = [
    pytest.mark.skipif(not MODEL.exists(), reason=f"model {MODEL} missing (scripts/fetch_model.sh)"),
    pytest.mark.skipif(subprocess.run([BIN, "serve", "--help"], capture_output=True).returncode != 0,
                       reason="kvpq built without libmicrohttpd (no kvpq serve)"),
]
CACHE = "q8_0"
EVICT_CACHE = "kivi2:w16"  # a windowed kind: codes and an fp16 window are saved and loaded back
CTX = 512
N = 12  # tokens per reply
THREADS = "2"
CONV = ["What is the capital of France?", "And of Italy?"]


class Server:
    def __init__(self, *extra, cache=CACHE):
        self.proc = subprocess.Popen(
            [BIN, "serve", "--model", str(MODEL), "--cache", cache, "--port", "0", "--ctx", str(CTX),
             "--threads", THREADS, *extra], stderr=subprocess.PIPE, text=True)
        line = self.proc.stderr.readline()
        assert "listening on http://" in line, line
        self.url = line.split("listening on ")[1].split()[0]
        self.log = []
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()

    def client(self, key="none"):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def server():
    s = Server("--parallel", "4", "--max-body", "64K")
    yield s
    assert s.stop() == 0


def http(url, body=None, method=None, headers=None):
    """(status, parsed JSON or text) of one raw request."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def cli_chat(messages, cache=CACHE):
    """`kvpq chat --temp 0 --json` over user messages: its rows (reply text and ids per turn)."""
    out = subprocess.run([BIN, "chat", "--model", str(MODEL), "--cache", cache, "--temp", "0", "-n", str(N),
                          "--ctx", str(CTX), "--threads", THREADS, "--json", "--quiet"],
                         input="\n".join(messages) + "\n", capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["results"]


def chat(client, messages, **kw):
    r = client.chat.completions.create(model="kvpq", messages=messages, max_tokens=N, temperature=0, **kw)
    return r


def converse(client, users):
    """Send a conversation turn by turn, each request carrying the replies so far; the responses."""
    msgs, out = [], []
    for u in users:
        msgs.append({"role": "user", "content": u})
        r = chat(client, msgs)
        out.append(r)
        msgs.append({"role": "assistant", "content": r.choices[0].message.content})
    return out


def test_chat_equals_cli_and_reuses_prefix(server):
    rows = cli_chat(CONV)
    resp = converse(server.client(), CONV)
    for row, r in zip(rows, resp):
        assert r.choices[0].message.content == row["reply"]
        assert r.choices[0].finish_reason == ("length" if row["stop"] == "length" else "stop")
        assert r.usage.completion_tokens == row["reply_tokens"]
    # turn 2 is the whole conversation's prompt; what turn 1 left in the cache is not evaluated again
    first_prompt = len(rows[0]["prompt_ids"])
    assert resp[1].usage.prompt_tokens == first_prompt + len(rows[0]["reply_ids"]) + len(rows[1]["prompt_ids"])
    # (the reply's text tokenizes back to the ids generated, so the whole first turn is reused)
    assert resp[1].usage.prompt_tokens_details.cached_tokens == first_prompt + len(rows[0]["reply_ids"])


def test_conversations_kept_apart(server):
    """Two users sharing the default system prompt: each continues its own cached conversation."""
    c = server.client()
    a = [{"role": "user", "content": "Name a fruit."}]
    b = [{"role": "user", "content": "Name a tree."}]
    ra, rb = chat(c, a), chat(c, b)
    for msgs, r in ((a, ra), (b, rb)):
        msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "Another?"}]
    for msgs, r in ((a, ra), (b, rb)):
        r2 = chat(c, msgs)
        assert r2.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_stream_equals_nonstream(server):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}]
    r = chat(server.client(), msgs)
    full = r.choices[0]
    chunks = list(server.client().chat.completions.create(model="kvpq", messages=msgs, max_tokens=N, temperature=0,
                                                          stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.message.content and len(text) > 0
    assert chunks[-2].choices[0].finish_reason == full.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1


def test_completion_equals_generate(server):
    prompt = "Once upon a time"
    out = subprocess.run([BIN, "generate", "--model", str(MODEL), "--cache", CACHE, "--prompt", prompt, "-n", str(N),
                          "--temp", "0", "--threads", THREADS, "--quiet"], capture_output=True, text=True, check=True)
    r = server.client().completions.create(model="kvpq", prompt=prompt, max_tokens=N, temperature=0)
    assert out.stdout == prompt + r.choices[0].text + "\n"
    s = server.client().completions.create(model="kvpq", prompt=prompt, max_tokens=N, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in s) == r.choices[0].text


def test_stop_sequence(server):
    msgs = [{"role": "user", "content": "Count from one to ten in words."}]
    full = chat(server.client(), msgs).choices[0].message.content
    assert len(full) >= 8, full
    stop = full[len(full) // 2:len(full) // 2 + 3]  # cut the reply in the middle
    cut = chat(server.client(), msgs, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == full[:full.index(stop)]
    streamed = server.client().chat.completions.create(model="kvpq", messages=msgs, max_tokens=N, temperature=0,
                                                       stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == cut.message.content


def test_concurrent_clients(server):
    prompts = [f"Write one sentence about the number {i}." for i in range(8)]
    got = [None] * len(prompts)

    def run(i):
        got[i] = chat(server.client(), [{"role": "user", "content": prompts[i]}]).choices[0].message.content

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    want = [cli_chat([p])[0]["reply"] for p in prompts[:2]]  # two against the CLI, all against sequential
    assert got[:2] == want
    for i, p in enumerate(prompts):
        assert chat(server.client(), [{"role": "user", "content": p}]).choices[0].message.content == got[i]
    assert len(set(got)) == len(got)


def metrics(server):
    status, text = http(server.url + "/metrics")
    assert status == 200
    return {k: float(v) for k, v in (line.split() for line in text.splitlines() if not line.startswith("#"))}


def test_client_disconnect_mid_stream(server):
    """A client that goes away mid-stream: its sequence is dropped, the server goes on."""
    import http.client
    before = metrics(server)
    host, port = server.url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"messages": [{"role": "user", "content": "Tell me a very long story."}], "max_tokens": 400,
            "temperature": 0, "stream": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    conn.sock.close()
    conn.close()
    for _ in range(200):  # 400 tokens take ~6 s here; cancelled, it ends within a few tokens
        m = metrics(server)
        if m["kvpq_requests_cancelled_total"] > before["kvpq_requests_cancelled_total"]:
            break
        time.sleep(0.05)
    assert m["kvpq_requests_cancelled_total"] == before["kvpq_requests_cancelled_total"] + 1
    assert m["kvpq_active_sequences"] == 0
    assert m["kvpq_completion_tokens_total"] - before["kvpq_completion_tokens_total"] < 300
    assert chat(server.client(), [{"role": "user", "content": "hi"}]).choices[0].message.content


def test_client_disconnect_waiting(server):
    """A client that goes away while waiting for a non-streamed reply: its sequence is dropped."""
    import socket
    before = metrics(server)
    host, port = server.url.split("//")[1].split(":")
    body = json.dumps({"messages": [{"role": "user", "content": "Tell me a very long story, please."}],
                       "max_tokens": 400, "temperature": 0}).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(0.5)
    for _ in range(200):
        m = metrics(server)
        if m["kvpq_requests_cancelled_total"] > before["kvpq_requests_cancelled_total"]:
            break
        time.sleep(0.05)
    assert m["kvpq_requests_cancelled_total"] == before["kvpq_requests_cancelled_total"] + 1
    assert m["kvpq_completion_tokens_total"] - before["kvpq_completion_tokens_total"] < 300


def test_evicted_conversation_continues(tmp_path):
    rows = cli_chat(CONV, cache=EVICT_CACHE)
    s = Server("--kv-budget", "1", "--cache-dir", str(tmp_path), cache=EVICT_CACHE)
    try:
        c = s.client()
        msgs = [{"role": "user", "content": CONV[0]}]
        a1 = chat(c, msgs).choices[0].message.content
        chat(c, [{"role": "user", "content": "Something else entirely."}])  # another conversation
        for _ in range(100):  # evicted right after the engine's round that ended it
            if len(list(tmp_path.glob("conv-*.kvpq"))) == 2:
                break
            time.sleep(0.05)
        assert len(list(tmp_path.glob("conv-*.kvpq"))) == 2, "the idle conversations were not saved"
        msgs += [{"role": "assistant", "content": a1}, {"role": "user", "content": CONV[1]}]
        r = chat(c, msgs)
        assert [a1, r.choices[0].message.content] == [rows[0]["reply"], rows[1]["reply"]]
        assert r.usage.prompt_tokens_details.cached_tokens >= len(rows[0]["prompt_ids"])
        m = metrics(s)
        assert m["kvpq_restores_total"] >= 1 and m["kvpq_evictions_total"] >= 2
    finally:
        assert s.stop() == 0
    # SIGTERM saved the idle conversations; a new server finds them in --cache-dir
    s = Server("--cache-dir", str(tmp_path), cache=EVICT_CACHE)
    try:
        msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "Thanks."}]
        r3 = chat(s.client(), msgs)
        assert r3.usage.prompt_tokens_details.cached_tokens > len(rows[0]["prompt_ids"])
    finally:
        assert s.stop() == 0


def settled_metrics(server):
    """/metrics once the engine's round after the last reply has been counted (no active sequence)."""
    for _ in range(200):
        m = metrics(server)
        if m["kvpq_active_sequences"] == 0 and m["kvpq_waiting_requests"] == 0:
            return m
        time.sleep(0.05)
    raise AssertionError("the server never went idle")


def test_budget_evicts_on_the_pools_refusal(tmp_path):
    """--kv-budget is one page pool: a budget of one and a half conversations' pages makes the pool
    refuse the second conversation's pages, which evicts the first (saved, then loaded back and
    continued as the CLI would); the pool never holds more than the budget once the round ends."""
    rows = cli_chat(CONV, cache=EVICT_CACHE)
    s = Server("--kv-budget", "1G", cache=EVICT_CACHE)
    try:
        a1 = chat(s.client(), [{"role": "user", "content": CONV[0]}]).choices[0].message.content
        one = settled_metrics(s)["kvpq_kv_pool_bytes_in_use"]
    finally:
        assert s.stop() == 0
    assert one > 0 and a1 == rows[0]["reply"]
    budget = int(one * 1.5)
    s = Server("--kv-budget", str(budget), "--cache-dir", str(tmp_path), cache=EVICT_CACHE)
    try:
        c = s.client()
        msgs = [{"role": "user", "content": CONV[0]}]
        assert chat(c, msgs).choices[0].message.content == a1
        m = settled_metrics(s)
        assert m["kvpq_kv_pool_refusals_total"] == 0 and m["kvpq_evictions_total"] == 0
        chat(c, [{"role": "user", "content": "Something else entirely, and a little longer than that."}])
        m = settled_metrics(s)
        assert m["kvpq_kv_pool_refusals_total"] >= 1 and m["kvpq_evictions_total"] >= 1, m
        assert m["kvpq_kv_pool_bytes_in_use"] + m["kvpq_kv_pool_bytes_free"] <= budget
        assert m["kvpq_kv_budget_bytes"] == budget
        assert len(list(tmp_path.glob("conv-*.kvpq"))) >= 1
        msgs += [{"role": "assistant", "content": a1}, {"role": "user", "content": CONV[1]}]
        r = chat(c, msgs)
        assert r.choices[0].message.content == rows[1]["reply"]
        assert r.usage.prompt_tokens_details.cached_tokens >= len(rows[0]["prompt_ids"])
        m = settled_metrics(s)
        assert m["kvpq_restores_total"] >= 1 and m["kvpq_kv_pool_bytes_in_use"] <= budget
    finally:
        assert s.stop() == 0


def test_sigterm_finishes_streams(tmp_path):
    """SIGTERM mid-stream: the stream runs to its end, the idle conversation is saved, exit 0."""
    s = Server("--cache-dir", str(tmp_path))
    stream = s.client().chat.completions.create(model="kvpq", messages=[{"role": "user", "content": "Tell a story."}],
                                                max_tokens=40, temperature=0, stream=True, stream_options=None)
    chunks = [next(stream), next(stream)]
    s.proc.send_signal(signal.SIGTERM)
    chunks += list(stream)
    assert s.proc.wait(timeout=60) == 0
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop") and text
    assert len(list(tmp_path.glob("conv-*.kvpq"))) == 1
    assert any("SIGTERM" in line for line in s.log)


LONG = "word " * (CTX + 10)
BAD = [  # (endpoint, body, status, param, code)
    ("chat/completions", b"{not json", 400, None, "invalid_json"),
    ("chat/completions", b"[1, 2]", 400, None, "invalid_json"),
    ("chat/completions", {"model": "m"}, 400, "messages", "missing_required_parameter"),
    ("chat/completions", {"messages": "hi"}, 400, "messages", "invalid_type"),
    ("chat/completions", {"messages": []}, 400, "messages", "invalid_value"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages", "invalid_type"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages", "invalid_value"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature", "invalid_type"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": 5}, 400, "temperature", "invalid_value"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5}, 400, "max_tokens", "invalid_type"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": 5}, 400, "stop", "invalid_type"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, 400, "stream", "invalid_type"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n", "unsupported_value"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": 1}},
     400, "include_usage", "invalid_type"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "presence_penalty": "x"}, 400, "presence_penalty", "invalid_type"),
    ("chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages", "context_length_exceeded"),
    ("chat/completions", {"messages": [{"role": "user", "content": LONG}], "stream": True}, 400, "messages", "context_length_exceeded"),
    ("completions", {"prompt": 7}, 400, "prompt", "invalid_type"),
    ("completions", {"prompt": LONG}, 400, "prompt", "context_length_exceeded"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x" * 70000}]}, 413, None, "request_too_large"),
    ("nowhere", {}, 404, None, "unknown_url"),
]


@pytest.mark.parametrize("endpoint,body,status,param,code", BAD, ids=[f"{i}-{b[2]}-{b[4]}" for i, b in enumerate(BAD)])
def test_bad_request(server, endpoint, body, status, param, code):
    got, err = http(f"{server.url}/v1/{endpoint}", body, method="POST")
    assert got == status, err
    e = err["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"]
    assert (e["param"], e["code"], e["type"]) == (param, code, "invalid_request_error")
    assert http(server.url + "/health")[0] == 200


def test_wrong_method(server):
    status, err = http(server.url + "/v1/chat/completions")
    assert status == 405 and err["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize("args,needle", [
    ([], "--model is required"),
    (["--model", str(MODEL), "--kv-budget", "lots"], "--kv-budget: expected a byte count"),
    (["--model", str(MODEL), "--port", "70000"], "--port"),
    (["--model", str(MODEL), "--parallel", "0"], "--parallel"),
    (["--model", str(MODEL), "--cache", "q9_0"], "q9_0"),
    (["--model", str(MODEL), "--api-key", ""], "--api-key is empty"),
    (["--model", str(MODEL), "--paralel", "2"], "did you mean '--parallel'"),
])
def test_cli_usage_errors(args, needle):
    r = subprocess.run([BIN, "serve", *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and needle in r.stderr, r.stderr


def test_port_in_use(server):
    port = server.url.rsplit(":", 1)[1]
    r = subprocess.run([BIN, "serve", "--model", str(MODEL), "--port", port], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "cannot listen" in r.stderr, r.stderr


def test_api_key():
    s = Server("--api-key", "s3cret")
    try:
        with pytest.raises(openai.AuthenticationError):
            chat(s.client("wrong"), [{"role": "user", "content": "hi"}])
        with pytest.raises(openai.AuthenticationError):
            chat(s.client("s3cre"), [{"role": "user", "content": "hi"}])
        assert http(s.url + "/v1/models")[0] == 401
        assert http(s.url + "/health")[0] == 200
        assert chat(s.client("s3cret"), [{"role": "user", "content": "hi"}]).choices[0].message.content
        assert s.client("s3cret").models.list().data[0].id == MODEL.name
    finally:
        assert s.stop() == 0
