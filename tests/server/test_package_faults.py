"""Faults of the model package while a request runs (a changed expert block, a truncated
experts.bin) are the server's: a 5xx in one line, never blamed on the client, no traceback; the
next request is served. An unexpected error mid-stream is one line for the client too."""

import http.client
import json

import pytest

from edgevl.errors import PackageError
from support.server import MSGS, post_reply

FAULT = "expert block 3 of layer 0 changed on disk; convert the model again and restart the server"


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
    # a lone request's prompt is the first decoder forward; a later one is a decode step
    owner, name = model.decoder, "forward"
    monkeypatch.setattr(owner, name, fail_after(0 if where == "prefill" else 2, getattr(owner, name)))
    capfd.readouterr()
    body = {"messages": MSGS, "max_tokens": 8}
    if streaming and where == "step":
        status, events = stream(port, body)
        assert status == 200 and events[-1] == "[DONE]", events
        error = json.loads(events[-2])["error"]
        assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
    else:  # a fault before the first token: still time for a status
        status, reply = stream(port, body) if streaming else post_reply(port, body)
        assert status == 500, reply
        error = reply["error"]
    assert error == {"message": f"the model package failed: {FAULT}", "type": "server_error", "param": None,
                     "code": "package_error"}, error
    one_line_log(capfd.readouterr().err)
    monkeypatch.undo()
    # the failed request's slot starts empty again; the next request is served from a whole one
    assert [] in [slot.keys for slot in server.engine.slots]
    status, reply = post_reply(port, body)
    assert status == 200, reply


def test_unexpected_error_mid_stream_is_one_line_for_the_client(server, monkeypatch, capfd):
    """A bug mid-stream: the client's error event says one line and where to look (it carried
    the raw exception text); the traceback goes to the server log, where it helps."""
    model = server.model
    real = model.decoder.forward
    calls = []

    def step(*a, **k):
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("index 7 is out of bounds\nfor axis 0 with size 3")
        return real(*a, **k)

    monkeypatch.setattr(model.decoder, "forward", step)
    capfd.readouterr()
    status, events = stream(server.server_address[1], {"messages": MSGS, "max_tokens": 8})
    assert status == 200 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["message"] == "internal server error (RuntimeError); see the server log" and error["type"] == \
        "server_error", error
    assert "RuntimeError: index 7" in capfd.readouterr().err
    monkeypatch.undo()
    assert post_reply(server.server_address[1], {"messages": MSGS, "max_tokens": 2})[0] == 200
