"""Prompts far longer than the context are refused from their length, before the model, in
bounded memory, with /health answering meanwhile; the count at the edge is exact, and counting a
long prompt piece by piece never exceeds the exact count."""

import http.client
import json
import re
import subprocess
import sys
import threading
import time

import pytest

from edgevl.demo import demo_package
from edgevl.generate import prepare
from support.server import MSGS, post_reply, send_raw, status_kb, wait_for


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
    assert wait_for(endless.gate.locked, 10) is not None
    yield endless
    s.close()
    assert wait_for(lambda: not endless.gate.locked(), 5) is not None


@pytest.mark.alone
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
        status, body = post_reply(port, {"messages": MSGS, "max_tokens": 2})
        assert status == 200, body
        before_kb = status_kb(proc.pid, "VmHWM")
        bomb = {"messages": [{"role": "user", "content": "word " * ((8 << 20) // 5)}], "max_tokens": 2}
        with HealthPoller(port) as health:
            time.sleep(0.2)
            t = time.perf_counter()
            status, body = post_reply(port, bomb, timeout=120)
            took = time.perf_counter() - t
            time.sleep(0.2)
        grown_mb = (status_kb(proc.pid, "VmHWM") - before_kb) / 1024
        status2, body2 = post_reply(port, {"messages": MSGS, "max_tokens": 2})
    finally:
        proc.kill()
        proc.wait()
    print(f"\ntext bomb: {status} in {took:.2f} s, VmHWM +{grown_mb:.0f} MB, /health slowest "
          f"{max(health.times):.3f} s of {len(health.times)}")
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert re.fullmatch(r"the prompt has at least \d+ tokens, but this model's maximum context length is 2048 "
                        r"tokens; shorten the prompt", body["error"]["message"]), body
    assert took < 3, took
    assert grown_mb < 200, grown_mb
    assert len(health.times) >= 3 and max(health.times) < 1, health.times
    assert status2 == 200, body2  # and the server goes on
    assert "Traceback" not in (tmp_path / "stderr").read_text()


@pytest.mark.alone
def test_prompt_over_the_context_is_refused_without_waiting_for_the_model(long_generation):
    """A prompt short enough to be counted but longer than the context: refused from its token
    count while another request holds the model (it used to queue behind it, to be refused by
    the prefill only once its turn came)."""
    port = long_generation.server_address[1]
    text = " ".join(f"w{i % 97}" for i in range(20000))  # ~100 K characters, well over 2048 tokens
    t = time.perf_counter()
    status, body = post_reply(port, {"messages": [{"role": "user", "content": text}], "max_tokens": 2}, timeout=30)
    took = time.perf_counter() - t
    assert status == 400 and ("but this model's maximum context length is 2048 tokens; shorten the prompt"
                                   in body["error"]["message"]), body
    assert took < 2 and long_generation.gate.locked(), took  # the first request still runs
    assert long_generation.gate.waiting == 0


def test_prompt_that_fits_is_not_refused_and_an_exact_overflow_is(server):
    """At the edge the count is exact: the largest prompt that fits runs, one token more does not."""
    model = server.model
    port = server.server_address[1]

    def tokens(n):
        return len(prepare(model, [{"role": "user", "content": "a" * n}]).input_ids)

    lo, hi = 1, 100_000  # the longest content that still fits the context
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if tokens(mid) < model.max_context else (lo, mid - 1)
    status, body = post_reply(port, {"messages": [{"role": "user", "content": "a" * lo}], "max_tokens": 1})
    assert status == 200, body
    status, body = post_reply(port, {"messages": [{"role": "user", "content": "a" * (lo + 1)}], "max_tokens": 1})
    assert status == 400 and body["error"]["message"].startswith(
        f"the prompt has {tokens(lo + 1)} tokens, but this model's maximum context length is 2048 tokens"), body


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
    from edgevl.tokenizer import Tokenizer
    from edgevl.verification.tiny import CORPUS
    from edgevl.verification.tokenizers import save_tokenizer, train_tokenizer

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
    assert long_generation.gate.locked()
