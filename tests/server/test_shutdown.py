"""`edgevl serve` under SIGTERM (what `docker stop`, systemd and Kubernetes send): the requests
under way finish, new ones get 503 and /health says draining, then the process exits 0; past
--shutdown-grace it stops anyway; a second SIGTERM stops at once."""

import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from edgevl.convert import convert
from edgevl.random_model import write_qwen3_5
from support.common import ROOT
from support.server import post, wait_for

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    """A tiny random Qwen3.5: its answers rarely end on their own, so a request runs to max_tokens."""
    root = tmp_path_factory.mktemp("drain")
    (root / "ck").mkdir()
    write_qwen3_5(root / "ck", seed=0)
    return convert(root / "ck", root / "pkg", dtype="fp32", progress=False)


def start(pkg, *args):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-m", "edgevl", "serve", str(pkg), "--port", "0", "--threads", "1",
                          "--speculative", "none", *map(str, args)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    m = re.search(r"127\.0\.0\.1:(\d+)/v1", p.stdout.readline())
    assert m, p.communicate(timeout=30)
    return p, int(m.group(1))


def health(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/health")
    r = conn.getresponse()
    body = json.loads(r.read())
    conn.close()
    return r.status, body["status"]


def stream(port, tokens, out: dict):
    """A streamed chat completion of ``tokens`` tokens, read to its end into ``out``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = {"messages": [{"role": "user", "content": "Tell a story."}], "max_tokens": tokens, "stream": True,
            **NO_THINKING}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    out["status"], out["events"] = r.status, []
    for line in r:
        if line.startswith(b"data: "):
            out["events"].append(line[6:].strip())
            out.setdefault("first", time.monotonic())
    conn.close()


def test_sigterm_finishes_the_requests_under_way_and_refuses_new_ones(pkg):
    p, port = start(pkg, "--shutdown-grace", 60)
    try:
        out = {}
        t = threading.Thread(target=stream, args=(port, 3000, out))
        t.start()
        assert wait_for(lambda: "first" in out, 60) is not None
        p.send_signal(signal.SIGTERM)
        assert wait_for(lambda: health(port) == (503, "draining"), 10) is not None
        status, reply, r = post(port, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert status == 503 and reply["error"]["code"] == "shutting_down" and r.getheader("Retry-After")
        assert p.poll() is None     # still serving the stream
        t.join(120)
        finals = [json.loads(e) for e in out["events"] if e != b"[DONE]"]
        assert out["status"] == 200 and out["events"][-1] == b"[DONE]"
        assert finals[-1]["choices"][0]["finish_reason"] == "length"     # the whole answer, not cut
        assert p.wait(30) == 0
        assert "every request ended" in p.stderr.read()
    finally:
        p.kill()
        p.wait()


def running(port) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/health")
    body = json.loads(conn.getresponse().read())
    conn.close()
    return body["running"] > 0


@pytest.mark.parametrize("grace, signals", [(1, 1), (60, 2)])
def test_past_the_grace_it_stops_and_a_second_sigterm_stops_at_once(pkg, grace, signals):
    """Four answers to the context end in one slot: about half a minute of work (7 s each here)."""
    long = {"messages": [{"role": "user", "content": "Tell a story."}], "max_tokens": 100000, "n": 4, **NO_THINKING}
    p, port = start(pkg, "--shutdown-grace", grace, "--parallel", 1)

    def ask():
        with contextlib.suppress(OSError, http.client.HTTPException):   # cut by the stop
            post(port, long, timeout=120)

    try:
        threading.Thread(target=ask, daemon=True).start()
        assert wait_for(lambda: running(port), 30) is not None
        p.send_signal(signal.SIGTERM)
        if signals == 2:
            assert wait_for(lambda: health(port) == (503, "draining"), 10) is not None
            p.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        assert p.wait(30) == 0 and time.monotonic() - t0 < 10
        if signals == 1:
            assert "stopped after 1 s with requests still under way" in p.stderr.read()
    finally:
        p.kill()
        p.wait()


def test_the_process_tells_the_answers_it_cut_before_it_exits(pkg):
    """`edgevl serve` past its grace: the cut answers' 503 and error event reach the clients
    before the process exits (its request threads die with it)."""
    p, port = start(pkg, "--shutdown-grace", 1, "--parallel", 2)
    long = {"messages": [{"role": "user", "content": "Tell a story."}], "max_tokens": 100000, **NO_THINKING}
    got = {}

    def plain():
        try:
            got["plain"] = post(port, long, timeout=120)
        except (OSError, http.client.HTTPException) as e:
            got["plain"] = e

    try:
        out = {}
        threads = [threading.Thread(target=stream, args=(port, 100000, out)), threading.Thread(target=plain)]
        for t in threads:
            t.start()
        assert wait_for(lambda: "first" in out, 60) is not None
        assert wait_for(lambda: health(port)[1] == "ok" and running(port), 30) is not None
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
        for t in threads:
            t.join(30)
        assert not isinstance(got["plain"], Exception), got["plain"]
        status, reply, _ = got["plain"]
        assert status == 503 and reply["error"]["code"] == "shutting_down", reply
        last = json.loads([e for e in out["events"] if e != b"[DONE]"][-1])
        assert last["error"]["code"] == "shutting_down", out["events"][-3:]
    finally:
        p.kill()
        p.wait()


def test_answers_cut_by_the_stop_are_503s_not_the_requests_fault():
    """Past the grace, the answers still under way end with 503 shutting_down (a plain answer) or
    a server_error event (a stream): the OpenAI clients retry those elsewhere, never a 400, and
    /metrics does not count them as the requests' mistakes."""
    import edgevl
    from edgevl.demo import demo_package
    from edgevl.server import make_server

    model = edgevl.load(demo_package())
    model.eos_ids = set()   # answers run on to max_tokens
    srv, _ = make_server(model, parallel=2)
    port, got = srv.server_address[1], {}
    long = {"messages": [{"role": "user", "content": "Describe the image."}], "max_tokens": 100000}

    def plain():
        got["plain"] = post(port, long)

    def streamed():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/chat/completions", json.dumps({**long, "stream": True}),
                     {"Content-Type": "application/json"})
        got["stream"] = [json.loads(line[6:]) for line in conn.getresponse()
                         if line.startswith(b"data: {")]
        conn.close()

    threads = [threading.Thread(target=f) for f in (plain, streamed)]
    for t in threads:
        t.start()
    assert wait_for(lambda: srv.gate.held == 2, 30) is not None
    metrics = srv.metrics
    assert srv.drain(0.1) is False
    srv.server_close()   # ends the engine, as `serve` does once the grace is over
    for t in threads:
        t.join(30)
    status, reply, r = got["plain"]
    assert status == 503 and reply["error"]["code"] == "shutting_down" and r.getheader("Retry-After"), reply
    last = got["stream"][-1]["error"]
    assert last["type"] == "server_error" and last["code"] == "shutting_down", last
    text = metrics.render()
    assert 'finish_reason="refused"' not in text and 'edgevl_answers_total{finish_reason="error"} 2' in text, text
