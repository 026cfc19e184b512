"""Talking to a live server over HTTP: a request and its reply, a raw request left running,
waiting for the server's state, and a process's memory from /proc."""

from __future__ import annotations

import http.client
import json
import re
import socket
import time

# one user turn for the demo model
MSGS = [{"role": "user", "content": "Describe the image."}]


def post(port, body, headers=None, timeout=120, path="/v1/chat/completions"):
    """(status, the reply as JSON or else its raw bytes, the response) of a chat completion."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    raw = r.read()
    conn.close()
    try:
        return r.status, json.loads(raw), r
    except ValueError:
        return r.status, raw, r


def post_reply(port, body, timeout=60):
    """(status, reply) of a chat completion: JSON when the server says it is, else the raw bytes."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    r = conn.getresponse()
    raw = r.read()
    conn.close()
    return r.status, (json.loads(raw) if r.getheader("Content-Type") == "application/json" else raw)


def send_raw(port, body: dict, headers: dict | None = None) -> socket.socket:
    """A chat completion request sent on a socket the caller keeps (and closes to hang up)."""
    data = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + extra
              + b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return s


def wait_for(cond, seconds):
    """Seconds until ``cond()`` held, or None when it did not within ``seconds``."""
    t0 = time.perf_counter()
    while not cond():
        if time.perf_counter() - t0 > seconds:
            return None
        time.sleep(0.01)
    return time.perf_counter() - t0


def status_kb(pid, key):
    """A kB field of /proc/PID/status (VmRSS, VmHWM, ...)."""
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.MULTILINE).group(1))
