"""A client that hangs up frees the model within a second (waiting in the queue, streaming, or
not); one that only closes its sending side (half-closed) still gets its answer and keeps its
place in the queue."""

import json
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import edgevl
from edgevl.demo import demo_package
from edgevl.server import make_server
from support.server import MSGS, post, send_raw, wait_for


@pytest.fixture(scope="module")
def endless():
    """The demo model with no end-of-text: a request without max_tokens runs to the 2048-token
    context end (several seconds), as a model that rambles would."""
    model = edgevl.load(demo_package())
    model.eos_ids = set()
    srv, _ = make_server(model, max_queue=4, parallel=1)   # one slot: the second request queues
    yield srv
    srv.stop()


def test_non_streaming_client_that_hangs_up_stops_generation(endless):
    port = endless.server_address[1]
    s = send_raw(port, {"messages": MSGS})  # no max_tokens: up to the context end
    assert wait_for(endless.gate.locked, 10) is not None
    time.sleep(0.3)
    s.close()
    took = wait_for(lambda: not endless.gate.locked(), 5)
    assert took is not None and took < 1.0, took
    assert len(endless.engine.slots[0].keys) < 1000  # stopped early, not at the 2048-token context end
    status, body, _ = post(port, {"messages": MSGS, "max_tokens": 3})  # the model serves the next one
    assert status == 200 and body["usage"]["completion_tokens"] == 3


def test_queued_client_that_hangs_up_leaves_the_queue(endless):
    port = endless.server_address[1]
    first = send_raw(port, {"messages": MSGS})
    assert wait_for(endless.gate.locked, 10) is not None
    second = send_raw(port, {"messages": MSGS, "max_tokens": 5})
    assert wait_for(lambda: endless.gate.waiting == 1, 5) is not None
    second.close()
    took = wait_for(lambda: endless.gate.waiting == 0, 5)
    assert took is not None and took < 1.0 and endless.gate.locked()  # the first still runs
    first.close()
    assert wait_for(lambda: not endless.gate.locked(), 5) is not None


def test_streaming_client_that_hangs_up_while_text_is_held_back(endless):
    """Every piece is held back (it may start a stop string), so no write would notice."""
    port = endless.server_address[1]
    s = send_raw(port, {"messages": MSGS, "stream": True, "stop": ["".join(chr(c) for c in range(32, 127))]})
    assert wait_for(endless.gate.locked, 10) is not None
    time.sleep(0.3)
    s.close()
    took = wait_for(lambda: not endless.gate.locked(), 5)
    assert took is not None and took < 1.0, took


def half_closed(port, body: dict, version: bytes = b"HTTP/1.1") -> bytes:
    """Send a request, then close the sending side only (as ``nc -N`` and some proxies do), and
    read everything the server answers until it closes."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    s.sendall(b"POST /v1/chat/completions " + version + b"\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(data) + data)
    s.shutdown(socket.SHUT_WR)
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    s.close()
    return out


def final_response(reply: bytes) -> tuple[bytes, bytes]:
    """(status line, body) of the final response, after any interim (1xx) ones."""
    while re.match(rb"HTTP/1\.[01] 1\d\d ", reply):
        reply = reply.split(b"\r\n\r\n", 1)[1]
    head, _, body = reply.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0], body


def sse_events(body: bytes) -> list[bytes]:
    """The events of a chunked text/event-stream body, its framing checked on the way."""
    data = b""
    while True:
        size, _, body = body.partition(b"\r\n")
        n = int(size, 16)
        assert body[n:n + 2] == b"\r\n", body[:200]
        if n == 0:
            assert body == b"\r\n"
            return [e for e in data.split(b"\n\n") if e]
        data, body = data + body[:n], body[n + 2:]


@pytest.mark.parametrize("stream", [False, True, "held back"])
def test_half_closed_client_gets_its_answer(endless, stream):
    """A client that closes its sending side after the request still reads: it used to be taken
    for one that hung up, and got nothing. (Held back: the text may start a stop string, so the
    server looks at the connection between tokens, and once a second writes an SSE comment to
    tell a half-close from a hang-up: the stream stays well-formed.)"""
    n = 400 if stream == "held back" else 12  # over a second: comments come
    body = {"messages": MSGS, "max_tokens": n, "stream": bool(stream)}
    if stream == "held back":
        body["stop"] = "".join(chr(c) for c in range(32, 127))
    reply = half_closed(endless.server_address[1], body)
    status, body = final_response(reply)
    assert status == b"HTTP/1.1 200 OK", reply[:300]
    if stream:
        events = sse_events(body)
        assert (events[-1] == b"data: [DONE]"
                and all(e == b": " or e.startswith(b"data: {") for e in events[:-1])), events
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
    else:
        assert json.loads(body)["usage"]["completion_tokens"] == n, body


def test_half_closed_http10_client_gets_its_answer(endless):
    """HTTP/1.0 allows no interim response to tell a half-close from a hang-up: the answer comes."""
    reply = half_closed(endless.server_address[1], {"messages": MSGS, "max_tokens": 5}, b"HTTP/1.0")
    assert reply.startswith(b"HTTP/1.1 200 OK\r\n"), reply[:300]  # no 1xx first
    assert json.loads(final_response(reply)[1])["usage"]["completion_tokens"] == 5


def test_an_http10_stream_has_no_chunks_and_ends_with_the_connection(endless):
    """HTTP/1.0 has no chunked encoding: the events come as they are and the close ends them."""
    body = json.dumps({"messages": MSGS, "max_tokens": 5, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", endless.server_address[1]), timeout=60) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        reply = b""
        while chunk := s.recv(65536):   # until the server closes
            reply += chunk
    head, _, events = reply.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding" not in head and b"Connection: close" in head, head
    events = [e for e in events.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and all(e.startswith(b"data: {") for e in events[:-1]), events[:3]
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_a_stream_nobody_reads_frees_its_slot(monkeypatch):
    """A client that stops reading its stream (its buffers full) is taken as gone after
    STALLED_STREAM seconds, so the next request gets the slot instead of waiting minutes."""
    from edgevl import server as server_module

    monkeypatch.setattr(server_module, "STALLED_STREAM", 1)
    model = edgevl.load(demo_package())
    model.eos_ids = set()   # the answer runs on
    srv, _ = make_server(model, parallel=1)
    port = srv.server_address[1]
    try:
        body = json.dumps({"messages": MSGS, "max_tokens": 100000, "stream": True, "logprobs": True,
                           "top_logprobs": 20}).encode()
        staller = socket.socket()
        staller.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        staller.connect(("127.0.0.1", port))
        staller.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body))   # and never reads
        assert wait_for(srv.gate.locked, 10) is not None
        t0 = time.monotonic()
        status, reply, _ = post(port, {"messages": MSGS, "max_tokens": 2}, timeout=60)
        assert status == 200 and time.monotonic() - t0 < 30, (status, time.monotonic() - t0)
        staller.close()
    finally:
        srv.stop()


def test_half_closed_client_keeps_its_place_in_the_queue(endless):
    port = endless.server_address[1]
    first = send_raw(port, {"messages": MSGS})
    assert wait_for(endless.gate.locked, 10) is not None
    with ThreadPoolExecutor(1) as pool:
        second = pool.submit(half_closed, port, {"messages": MSGS, "max_tokens": 4})
        assert wait_for(lambda: endless.gate.waiting == 1, 5) is not None
        time.sleep(1.0)  # several looks at the connection while it waits
        assert endless.gate.waiting == 1 and endless.gate.locked()
        first.close()
        status, body = final_response(second.result(timeout=30))
    assert status == b"HTTP/1.1 200 OK" and json.loads(body)["usage"]["completion_tokens"] == 4, body


def test_requests_are_served_with_many_idle_connections_open(endless):
    """Past about 1000 open connections a new one's descriptor is above 1024, where select()
    fails: the hang-up check must still work there (idle keep-alive clients, or anyone with no key)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048 <= hard or hard == resource.RLIM_INFINITY:
        resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
    port = endless.server_address[1]
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(600)]  # both ends in this process

    def past_1024():     # once the server has accepted them, a new descriptor is past 1024 (it may lag)
        probe = socket.socket()
        n = probe.fileno()
        probe.close()
        return n > 1024 or None
    try:
        assert wait_for(past_1024, 20) is not None
        status, body, _ = post(port, {"messages": MSGS, "max_tokens": 3})
        assert status == 200 and body["usage"]["completion_tokens"] == 3, body
        s = send_raw(port, {"messages": MSGS})   # and a hang-up up there is still seen
        assert wait_for(endless.gate.locked, 10) is not None
        s.close()
        took = wait_for(lambda: not endless.gate.locked(), 5)
        assert took is not None and took < 1.0, took
    finally:
        for c in idle:
            c.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
