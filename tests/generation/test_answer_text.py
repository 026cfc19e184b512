"""The answer's text is what its tokens spell, the same on every surface: a raw continuation keeps its
leading newlines (they follow no reasoning marker), content beside tool calls joins alike streamed
and not, and the Responses API keeps an answer's leading blank when tools were offered. The model's
tokens are given here (its generate_tokens replaced), the reference is transformers' decode."""

import http.client
import json

import pytest

import edgevl
from edgevl import verification
from edgevl.engine import Engine
from edgevl.model import Model
from edgevl.server import make_server

SAY = {"type": "function", "function": {"name": "say", "description": "d", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
CALL = "<tool_call>\n<function=say>\n<parameter=text>\nhi\n</parameter>\n</function>\n</tool_call>"
SEQ: list = []


def _fake(self, input_ids, max_new_tokens=256, *a, **kw):
    yield from SEQ[:max_new_tokens]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("text")
    v = verification.get("qwen3_5")
    ck = v.make_tiny(root / "ck", variant=list(v.tiny_variants)[0], seed=5)
    mp = pytest.MonkeyPatch()
    mp.setattr(Model, "generate_tokens", _fake)
    mp.setattr(Engine, "generate_tokens", lambda self, *a, **k: _fake(self.model, *a, **k))
    model = edgevl.load(edgevl.convert(ck, root / "pk", dtype="fp32", progress=False), threads=1)
    srv, _ = make_server(model, parallel=1)
    yield model, srv.server_address[1], AutoTokenizer.from_pretrained(ck)
    srv.stop()
    model.close()
    mp.undo()


def _post(port, path, body):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    r = conn.getresponse()
    raw = r.read().decode()
    conn.close()
    assert r.status == 200, raw
    if not body.get("stream"):
        return json.loads(raw)
    return [json.loads(line[6:]) for line in raw.split("\n") if line.startswith("data: ") and line[6:] != "[DONE]"]


def _ids(hf, text, think=True):
    enc = lambda s: hf.encode(s, add_special_tokens=False)   # noqa: E731
    head = enc("r") + [hf.convert_tokens_to_ids("</think>")] if think else []
    return head + enc(text) + [hf.convert_tokens_to_ids("<|im_end|>")]


def test_a_raw_continuation_keeps_its_leading_newlines(setup):
    model, port, hf = setup
    SEQ[:] = _ids(hf, "\n    return 1\n", think=False)
    want = hf.decode(SEQ, skip_special_tokens=True)
    assert want == "\n    return 1\n"
    assert edgevl.generate(model, "def f():", raw=True, max_new_tokens=20) == want
    assert edgevl.complete(model, "def f():", raw=True, max_new_tokens=20).text == want
    assert _post(port, "/v1/completions", {"prompt": "def f():", "max_tokens": 20})["choices"][0]["text"] == want


def test_content_beside_calls_joins_alike_streamed_and_not(setup):
    model, port, hf = setup
    SEQ[:] = _ids(hf, "  你好\n\n" + CALL + "\n\nDone  ")
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [SAY], "max_tokens": len(SEQ) + 1}
    whole = _post(port, "/v1/chat/completions", body)["choices"][0]["message"]
    chunks = _post(port, "/v1/chat/completions", {**body, "stream": True})
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    # the blank before the call is no one's; the text after it keeps its own
    assert whole["tool_calls"] and whole["content"] == streamed == "  你好\n\nDone  "
    c = edgevl.complete(model, "hi", tools=[SAY], max_new_tokens=len(SEQ) + 1)
    assert c.text == streamed and len(c.tool_calls) == 1
    rb = {"input": "hi", "tools": [{"type": "function", **SAY["function"]}], "max_output_tokens": len(SEQ) + 1}
    out = _post(port, "/v1/responses", rb)["output"]
    text = "".join(p["text"] for o in out if o["type"] == "message" for p in o["content"])
    events = _post(port, "/v1/responses", {**rb, "stream": True})
    deltas = "".join(e["delta"] for e in events if e.get("type") == "response.output_text.delta")
    assert text == deltas and [o["type"] for o in out].count("function_call") == 1
    assert text.startswith("  你好")


@pytest.mark.parametrize("answer", ["  indented", "\tcode:\n  x = 1"])
def test_the_responses_api_keeps_an_answers_leading_blank_when_tools_were_offered(setup, answer):
    model, port, hf = setup
    SEQ[:] = _ids(hf, answer)
    chat = _post(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [SAY],
                                                "max_tokens": len(SEQ) + 1})["choices"][0]["message"]["content"]
    rb = {"input": "hi", "tools": [{"type": "function", **SAY["function"]}], "max_output_tokens": len(SEQ) + 1}
    out = _post(port, "/v1/responses", rb)["output"]
    text = "".join(p["text"] for o in out if o["type"] == "message" for p in o["content"])
    events = _post(port, "/v1/responses", {**rb, "stream": True})
    deltas = "".join(e["delta"] for e in events if e.get("type") == "response.output_text.delta")
    assert chat == text == deltas == answer


def test_a_call_tag_that_opens_no_call_leaves_the_text_as_written(setup):
    """The token limit right after <tool_call>, or a small model's malformed call: the blank
    before the tag was dropped with the call that never came."""
    from edgevl import tools

    spec = tools.prepare(setup[0], [SAY], "auto")
    for text in ("Hello\n\n<tool_call>", "Hello\n\n<tool_call>\noops, no function tag", "Checking.\n" + CALL[:-12]):
        assert tools.parse(text, spec) == (text, [])


@pytest.mark.parametrize("text", ["Let me look.\n\n" + CALL, "Hello\n\n<tool_call>", CALL + "\n" + CALL,
                                  "  你好\n\n" + CALL + "\n\nDone  ", "Checking.\n" + CALL[:-12],
                                  "a \n" + CALL + " b \n" + CALL + "\n", "plain  \n"])
def test_a_streams_content_joins_to_the_whole_answers(setup, text):
    """Fed in pieces of any size, the content events join to what the whole answer parses to."""
    from edgevl import tools

    model = setup[0]
    spec = tools.prepare(model, [SAY], "auto")
    content, calls = tools.parse(text, spec)
    for step in (1, 2, 3, 5, 8, 13):
        s = tools.CallStream(spec)
        events = [e for i in range(0, len(text), step) for e in s.feed(text[i:i + step])] + s.feed("", end=True)
        assert "".join(e[1] for e in events if e[0] == "content") == content, (text, step)
        assert len([e for e in events if e[0] == "name"]) == len(calls)
