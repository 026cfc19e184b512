"""The server under requests that cost it more than a client should be able to make it spend:
prompts far longer than the context (refused from their length, before the model, in bounded
memory, /health answering meanwhile), and faults of the model package while a request runs
(a 5xx in one line, never blamed on the client, no traceback)."""

import http.client
import json
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

import edgevl
from edgevl.demo import demo_package
from edgevl.errors import PackageError
from edgevl.server import make_server

MSGS = [{"role": "user", "content": "Describe the image."}]
FAULT = "expert block 3 of layer 0 changed on disk; convert the model again and restart the server"


def post(port, body, timeout=60):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    r = conn.getresponse()
    raw = r.read()
    conn.close()
    return r.status, (json.loads(raw) if r.getheader("Content-Type") == "application/json" else raw)


def get_health(port, timeout=10) -> float:
    """Seconds /health took to answer."""
    t = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("GET", "/health")
    r = conn.getresponse()
    assert r.status == 200 and json.loads(r.read())["status"] == "ok"
    conn.close()
    return time.perf_counter() - t


class HealthPoller:
    """Asks /health every 50 ms in a thread, recording how long each answer took."""

    def __init__(self, port):
        self.port, self.times, self.done = port, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.done.is_set():
            self.times.append(get_health(self.port, timeout=60))
            time.sleep(0.05)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join(120)


def send_raw(port, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return s


def wait_for(cond, seconds):
    t0 = time.perf_counter()
    while not cond():
        if time.perf_counter() - t0 > seconds:
            return None
        time.sleep(0.01)
    return time.perf_counter() - t0


@pytest.fixture(scope="module")
def server():
    srv, _ = make_server(edgevl.load(demo_package()), max_queue=4)
    yield srv
    srv.stop()


@pytest.fixture
def endless(server, monkeypatch):
    """The server's model with no end-of-text: a request without max_tokens runs to the 2048-token
    context end (several seconds)."""
    monkeypatch.setattr(server.model, "eos_ids", set())
    return server


@pytest.fixture
def long_generation(endless):
    """A non-streaming request that holds the model until the test ends (then it hangs up)."""
    s = send_raw(endless.server_address[1], {"messages": MSGS})
    assert wait_for(endless.gate.lock.locked, 10) is not None
    yield endless
    s.close()
    assert wait_for(lambda: not endless.gate.lock.locked(), 5) is not None


# -- prompts far longer than the context --------------------------------------------------------

def status_kb(pid, key):
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.MULTILINE).group(1))


def test_text_bomb_is_refused_fast_in_bounded_memory(tmp_path):
    """8 MB of text in one message (under the 20 MB body limit): was tokenized whole with the
    model held (8 M tokens: 2 GB more memory, seconds during which the tokenizer held the GIL and
    /health waited), only for the prefill to refuse it. Now its length alone refuses it: 400 at
    once, the server process's peak memory (VmHWM) grows by no more than a few copies of the body,
    and /health answers within a second meanwhile."""
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "edgevl", "serve", str(demo_package()), "--port", "0",
                                 "--threads", "1"], stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        port = int(re.search(r"127\.0\.0\.1:(\d+)", proc.stdout.readline()).group(1))
        status, body = post(port, {"messages": MSGS, "max_tokens": 2})
        assert status == 200, body
        before_kb = status_kb(proc.pid, "VmHWM")
        bomb = {"messages": [{"role": "user", "content": "word " * ((8 << 20) // 5)}], "max_tokens": 2}
        with HealthPoller(port) as health:
            time.sleep(0.2)
            t = time.perf_counter()
            status, body = post(port, bomb, timeout=120)
            took = time.perf_counter() - t
            time.sleep(0.2)
        grown_mb = (status_kb(proc.pid, "VmHWM") - before_kb) / 1024
        status2, body2 = post(port, {"messages": MSGS, "max_tokens": 2})
    finally:
        proc.kill()
        proc.wait()
    print(f"\ntext bomb: {status} in {took:.2f} s, VmHWM +{grown_mb:.0f} MB, /health slowest "
          f"{max(health.times):.3f} s of {len(health.times)}")
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert re.fullmatch(r"the prompt has at least \d+ tokens but the model's context is 2048; shorten the "
                        r"prompt", body["error"]["message"]), body
    assert took < 3, took
    assert grown_mb < 200, grown_mb
    assert len(health.times) >= 3 and max(health.times) < 1, health.times
    assert status2 == 200, body2  # and the server goes on
    assert "Traceback" not in (tmp_path / "stderr").read_text()


def test_prompt_over_the_context_is_refused_without_waiting_for_the_model(long_generation):
    """A prompt short enough to be counted but longer than the context: refused from its token
    count while another request holds the model (it used to queue behind it, to be refused by
    the prefill only once its turn came)."""
    port = long_generation.server_address[1]
    text = " ".join(f"w{i % 97}" for i in range(20000))  # ~100 K characters, well over 2048 tokens
    t = time.perf_counter()
    status, body = post(port, {"messages": [{"role": "user", "content": text}], "max_tokens": 2}, timeout=30)
    took = time.perf_counter() - t
    assert status == 400 and "but the model's context is 2048; shorten the prompt" in body["error"]["message"], body
    assert took < 2 and long_generation.gate.lock.locked(), took  # the first request still runs
    assert long_generation.gate.waiting == 0


def test_prompt_that_fits_is_not_refused_and_an_exact_overflow_is(server):
    """At the edge the count is exact: the largest prompt that fits runs, one token more does not."""
    from edgevl.generate import prepare

    model = server.model
    port = server.server_address[1]

    def tokens(n):
        return len(prepare(model, [{"role": "user", "content": "a" * n}]).input_ids)

    lo, hi = 1, 100_000  # the longest content that still fits the context
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if tokens(mid) < model.max_context else (lo, mid - 1)
    status, body = post(port, {"messages": [{"role": "user", "content": "a" * lo}], "max_tokens": 1})
    assert status == 200, body
    status, body = post(port, {"messages": [{"role": "user", "content": "a" * (lo + 1)}], "max_tokens": 1})
    assert status == 400 and body["error"]["message"].startswith(
        f"the prompt has {tokens(lo + 1)} tokens but the model's context is 2048"), body


TEXTS = [
    "word " * 3000,
    " ".join(f"w{i % 97}" for i in range(2000)),
    "语言模型" * 800 + "\n\n" + "tabs\t\tand   spaces   " * 100,
    "x" * 5000,                                                   # no whitespace: hard cuts inside a word
    "<|end_of_text|><|begin_of_text|>user\n" * 100,               # special tokens' text
    "\n" * 3000 + " " * 3000 + "é" * 3000 + "🙂" * 1000,
]


@pytest.fixture(scope="module")
def tokenizers(server, tmp_path_factory):
    """The demo's tokenizer and a byte-level BPE trained on TEXTS too: its tokens span up to 192
    characters, and cuts through long runs split them (summed over the pieces, the counts exceed
    the real one, e.g. 1584 against 1551 in 64-character pieces, unless the tokens near each cut
    are left out)."""
    from edgevl.verification.tokenizers import save_tokenizer, train_tokenizer
    from edgevl.verification.tiny import CORPUS
    from edgevl.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("trained-tokenizer")
    save_tokenizer(train_tokenizer(list(CORPUS) + [t[:300] for t in TEXTS], vocab_size=600), folder)
    return {"demo": server.model.tokenizer, "trained": Tokenizer(folder)}


@pytest.mark.parametrize("name", ["demo", "trained"])
@pytest.mark.parametrize("piece", [7, 64, 1000, 1 << 15])
@pytest.mark.parametrize("i", range(len(TEXTS)))
def test_token_count_by_pieces_never_exceeds_the_exact_count(tokenizers, monkeypatch, name, piece, i):
    """The length check counts a long prompt's tokens piece by piece (bounded memory); a cut can
    split what the whole text tokenizes as one token, so the count it refuses on must stay a
    lower bound of the real one, however small the pieces."""
    from edgevl import server as S

    monkeypatch.setattr(S, "PIECE", piece)
    tok = tokenizers[name]
    text = TEXTS[i]
    exact = len(tok.encode(text))
    bound, exact_count = S.count_tokens(tok, text, limit=10 ** 9)
    assert bound <= exact, (bound, exact)
    assert exact_count == (len(text) <= piece) and (bound == exact or not exact_count)
    assert S.count_tokens(tok, text, limit=10)[0] <= exact  # stopped early, still a lower bound


def test_health_answers_while_the_model_is_busy(long_generation):
    port = long_generation.server_address[1]
    for _ in range(5):
        assert get_health(port) < 1
        time.sleep(0.1)
    assert long_generation.gate.lock.locked()


# -- faults of the model package ----------------------------------------------------------------

def fail_after(n_ok, real):
    calls = []

    def step(*a, **k):
        calls.append(1)
        if len(calls) > n_ok:
            raise PackageError(FAULT)
        return real(*a, **k)

    return step


def stream(port, body):
    """Status and the data of each server-sent event."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    raw = r.read().decode()
    conn.close()
    if r.status != 200:
        return r.status, json.loads(raw)
    return r.status, [line[6:] for line in raw.split("\n") if line.startswith("data: ")]


def one_line_log(err: str) -> None:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [f"edgevl: the model package failed: {FAULT}"], err


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("where", ["prefill", "step"])
def test_package_fault_is_a_server_error_in_one_line(server, monkeypatch, capfd, where, streaming):
    """The package failing under the running model (a changed expert block, a truncated
    experts.bin) is the server's fault: in the prompt it was a 400 blaming the client, mid-decode
    a traceback on stderr and a 500 saying nothing. Now: 500 ``the model package failed: ...``
    (streaming: a final error event, then the stream ends), one line in the log, and the next
    request is served (from a fresh cache: the failed step may have left it half-written)."""
    model = server.model
    port = server.server_address[1]
    monkeypatch.setattr(model, where, fail_after(0 if where == "prefill" else 2, getattr(model, where)))
    capfd.readouterr()
    body = {"messages": MSGS, "max_tokens": 8}
    if streaming and where == "step":
        status, events = stream(port, body)
        assert status == 200 and events[-1] == "[DONE]", events
        error = json.loads(events[-2])["error"]
        assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
    else:  # a fault before the first token: still time for a status
        status, reply = stream(port, body) if streaming else post(port, body)
        assert status == 500, reply
        error = reply["error"]
    assert error == {"message": f"the model package failed: {FAULT}", "type": "server_error", "param": None,
                     "code": "package_error"}, error
    one_line_log(capfd.readouterr().err)
    monkeypatch.undo()
    assert model.cache_keys == []
    status, reply = post(port, body)
    assert status == 200 and reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, reply


def test_unexpected_error_mid_stream_is_one_line_for_the_client(server, monkeypatch, capfd):
    """A bug mid-stream: the client's error event says one line and where to look (it carried
    the raw exception text); the traceback goes to the server log, where it helps."""
    model = server.model
    real = model.step
    calls = []

    def step(*a, **k):
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("index 7 is out of bounds\nfor axis 0 with size 3")
        return real(*a, **k)

    monkeypatch.setattr(model, "step", step)
    capfd.readouterr()
    status, events = stream(server.server_address[1], {"messages": MSGS, "max_tokens": 8})
    assert status == 200 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["message"] == "internal server error (RuntimeError); see the server log" and error["type"] == \
        "server_error", error
    assert "RuntimeError: index 7" in capfd.readouterr().err
    monkeypatch.undo()
    assert post(server.server_address[1], {"messages": MSGS, "max_tokens": 2})[0] == 200
