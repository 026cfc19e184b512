"""Client mistakes get a 400 (never a 500) naming the field: wrong types, values out of range,
invalid Unicode, options the server does not take, conflicting or chunked Content-Length; absurd
sampling values are greedy or bounded."""

import http.client
import json
import socket

import pytest

import edgevl
from edgevl.server import make_server
from support.server import MSGS, post
from support.youtu import tiny_checkpoint


@pytest.fixture(scope="module")
def text_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-server")
    pkg = edgevl.convert(tiny_checkpoint(root / "ck"), root / "tiny", dtype="fp32", progress=False)
    srv, _ = make_server(pkg, model_name="tiny")
    yield srv
    srv.stop()


BAD_REQUESTS = [  # (id, body, status, words)
    ("model-list", {"model": ["x"], "messages": MSGS}, 400, "model must be a string"),
    ("model-object", {"model": {"id": "tiny"}, "messages": MSGS}, 400, "model must be a string"),
    ("model-number", {"model": 7, "messages": MSGS}, 400, "model must be a string"),
    ("surrogate-content", {"messages": [{"role": "user", "content": "a\ud800b"}]}, 400, "messages[0].content"),
    ("surrogate-part", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}, 400,
     "messages[0].content[0].text"),
    ("surrogate-stop", {"messages": MSGS, "stop": ["\ud83d"]}, 400, "stop[0] contains invalid Unicode"),
    ("surrogate-key", {"messages": MSGS, "\ud800": 1}, 400, "invalid Unicode"),
    ("temperature-nan", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400,
     "temperature must be a number"),
    ("temperature-inf", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}', 400,
     "temperature must be a number"),
    ("top-p-huge-exponent", b'{"messages": [{"role": "user", "content": "hi"}], "top_p": 1e999}', 400, "top_p"),
    ("n-list", {"messages": MSGS, "n": [1]}, 400, "n must be an integer from 1 to 16"),
    ("n-zero", {"messages": MSGS, "n": 0}, 400, "n must be an integer from 1 to 16"),
    ("n-many", {"messages": MSGS, "n": 17}, 400, "n must be an integer from 1 to 16"),
    ("n-bool", {"messages": MSGS, "n": True}, 400, "n must be an integer from 1 to 16"),
    ("effort", {"messages": MSGS, "reasoning_effort": "max"}, 400, "reasoning_effort must be one of none"),
    ("seed-negative", {"messages": MSGS, "seed": -5}, 400, "seed must be >= 0"),
    ("logprobs-string", {"messages": MSGS, "logprobs": "yes"}, 400, "logprobs must be true or false"),
    ("top-logprobs-range", {"messages": MSGS, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs must be an integer from 0 to 20"),
    ("top-logprobs-alone", {"messages": MSGS, "logprobs": False, "top_logprobs": 3}, 400,
     "top_logprobs needs logprobs: true"),
    ("min-p-range", {"messages": MSGS, "min_p": 1.5}, 400, "min_p must be from 0 to 1"),
    ("logit-bias-list", {"messages": MSGS, "logit_bias": [1]}, 400, "logit_bias must be an object"),
    ("logit-bias-key", {"messages": MSGS, "logit_bias": {"the": 1}}, 400, "logit_bias keys must be token ids"),
    ("logit-bias-past-vocab", {"messages": MSGS, "logit_bias": {"99999999": 1}}, 400,
     "logit_bias keys must be token ids"),
    ("logit-bias-range", {"messages": MSGS, "logit_bias": {"1": 101}}, 400,
     "logit_bias values must be numbers from -100"),
    ("presence-penalty-range", {"messages": MSGS, "presence_penalty": 2.5}, 400,
     "presence_penalty must be from -2 to 2"),
    ("frequency-penalty-string", {"messages": MSGS, "frequency_penalty": "1"}, 400,
     "frequency_penalty must be a number"),
    ("image-on-text-model", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, 400, "no vision tower"),
    # "false" is a true value to the template: thinking stayed on
    ("thinking-string", {"messages": MSGS, "chat_template_kwargs": {"enable_thinking": "false"}}, 400,
     "chat_template_kwargs enable_thinking must be true or false (a JSON boolean), got 'false'"),
    # a string that reads as a boolean, whatever the template (this model's has no such switch)
    ("vision-id-string", {"messages": MSGS, "chat_template_kwargs": {"add_vision_id": "0"}}, 400,
     "add_vision_id must be true or false"),
    # the template would render them into the prompt unchecked: they belong in the tools field
    ("tools-in-template-kwargs", {"messages": MSGS, "chat_template_kwargs": {"tools": [
        {"type": "function", "function": {"name": "f", "parameters": {}}}]}}, 400,
     "tools go in the request's tools field, not in chat_template_kwargs"),
    ("functions-in-template-kwargs", {"messages": MSGS, "chat_template_kwargs": {"functions": [{"name": "f"}]}}, 400,
     "tools go in the request's tools field, not in chat_template_kwargs"),
    # JSON numbers of any size: an integer past float's range is a mistake, not a 500
    ("max-tokens-huge-int", {"messages": MSGS, "max_tokens": 10 ** 400}, 400, "max_tokens must be an integer"),
    # the field the client sent is the one named
    ("max-completion-tokens-zero", {"messages": MSGS, "max_completion_tokens": 0}, 400,
     "max_completion_tokens must be >= 1, got 0"),
    ("max-tokens-negative", {"messages": MSGS, "max_tokens": -3}, 400, "max_tokens must be >= 1, got -3"),
    ("temperature-huge-int", {"messages": MSGS, "temperature": 10 ** 400}, 400, "temperature must be a number"),
    ("seed-huge-int", {"messages": MSGS, "seed": 10 ** 400}, 400, "seed must be an integer"),
    ("min-p-huge-int", {"messages": MSGS, "min_p": 10 ** 400}, 400, "min_p must be a number"),
    ("logit-bias-huge-value", {"messages": MSGS, "logit_bias": {"1": 10 ** 400}}, 400, "logit_bias values"),
    ("logit-bias-huge-key", {"messages": MSGS, "logit_bias": {"1" * 5000: 1}}, 400, "logit_bias keys"),
    ("stop-object", {"messages": MSGS, "stop": {}}, 400, "stop must be a string or a list of strings"),
    ("include-usage-string", {"messages": MSGS, "stream": True, "stream_options": {"include_usage": "yes"}}, 400,
     "stream_options.include_usage must be true or false"),
    ("text-part-number", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400,
     "messages[0].content[0].text must be a string"),
]


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_client_mistakes_get_400(text_server, case):
    body = case[1] if isinstance(case[1], bytes) else json.dumps(case[1]).encode()
    status, reply, _ = post(text_server.server_address[1], body)
    assert status == case[2], reply
    assert case[3] in reply["error"]["message"] and reply["error"]["type"] == "invalid_request_error", reply
    assert "\n" not in reply["error"]["message"]


TEXT_COMPLETION_MISTAKES = [
    ("no-prompt", {}, "prompt must be a string"),
    ("token-ids", {"prompt": [1, 2, 3]}, "prompt must be a string (token id prompts are not supported)"),
    ("two-prompts", {"prompt": ["a", "b"]}, "one prompt per request"),
    ("blank", {"prompt": " \n"}, "the prompt is empty"),
    ("suffix", {"prompt": "a", "suffix": "b"}, "suffix (fill in the middle) is not supported"),
    ("best-of", {"prompt": "a", "best_of": 3}, "only best_of=1"),
    ("echo-string", {"prompt": "a", "echo": "yes"}, "echo must be true or false"),
    ("logprobs-bool", {"prompt": "a", "logprobs": True}, "logprobs must be an integer from 0 to 20"),
    ("logprobs-range", {"prompt": "a", "logprobs": 21}, "logprobs must be an integer from 0 to 20"),
    ("echo-logprobs", {"prompt": "a", "echo": True, "logprobs": 1}, "echo with logprobs"),
    ("n", {"prompt": "a", "n": 100}, "n must be an integer from 1 to 16"),
    ("bias", {"prompt": "a", "logit_bias": {"1": 500}}, "logit_bias values"),
    ("too-long", {"prompt": "word " * 20000}, "but this model's maximum context length is"),
    ("max-tokens-huge-int", {"prompt": "a", "max_tokens": 10 ** 400}, "max_tokens must be an integer"),
    ("tools", {"prompt": "a", "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools need a chat template"),
]


@pytest.mark.parametrize("case", TEXT_COMPLETION_MISTAKES, ids=[c[0] for c in TEXT_COMPLETION_MISTAKES])
def test_text_completion_mistakes_get_400(text_server, case):
    status, reply, _ = post(text_server.server_address[1], case[1], path="/v1/completions")
    assert status == 400 and case[2] in reply["error"]["message"], reply
    assert "\n" not in reply["error"]["message"]


def test_denormal_and_absurd_sampling_values_are_greedy_or_bounded(text_server):
    port = text_server.server_address[1]
    greedy = post(port, {"messages": MSGS, "max_tokens": 6, "temperature": 0})[1]["choices"][0]["message"]
    for extra in ({"temperature": 1e-320}, {"temperature": 5e-324, "top_p": 1e-320}, {"top_k": 10 ** 30},
                  {"repetition_penalty": 1e-300, "temperature": 1e-310},
                  {"repetition_penalty": 1e-300, "temperature": 0.7, "seed": 1},
                  {"temperature": 1e-300, "seed": 2}, {"temperature": 1e300, "seed": 3},
                  {"presence_penalty": -2, "frequency_penalty": 2, "logprobs": False, "top_logprobs": 0}):
        status, body, _ = post(port, {"messages": MSGS, "max_tokens": 6, **extra})
        assert status == 200, (extra, body)
        if extra.get("temperature", 1) < 1e-100 and "repetition_penalty" not in extra:
            assert body["choices"][0]["message"] == greedy, extra  # the limit of temperature -> 0


def test_vllms_top_k_minus_one_is_top_k_off(text_server):
    port = text_server.server_address[1]
    plain = post(port, {"messages": MSGS, "max_tokens": 4, "temperature": 0.9, "seed": 5})
    off = post(port, {"messages": MSGS, "max_tokens": 4, "temperature": 0.9, "seed": 5, "top_k": -1})
    assert off[0] == 200 and off[1]["choices"][0]["message"] == plain[1]["choices"][0]["message"], off


def test_echo_null_is_left_out(text_server):
    status, reply, _ = post(text_server.server_address[1], {"prompt": "a", "echo": None, "max_tokens": 1},
                            path="/v1/completions")
    assert status == 200, reply


@pytest.mark.parametrize("field, value, words", [
    ("temperature", -1, "temperature must be a finite number >= 0"), ("top_p", 1.5, "top_p must be in (0, 1]"),
    ("top_p", 0, "top_p must be in (0, 1]"), ("top_k", -2, "top_k must be >= 0"),
    ("repetition_penalty", 0, "repetition_penalty must be a finite number > 0")])
def test_sampling_values_are_refused_before_the_request_waits(busy_server, field, value, words):
    """Out of range: a 400 naming the field at once, while every slot is taken and the queue is
    full (a request that is fine gets the 429), not after waiting for a slot."""
    port = busy_server.server_address[1]
    assert post(port, {"messages": MSGS, "max_tokens": 1})[0] == 429
    status, reply, _ = post(port, {"messages": MSGS, "max_tokens": 1, field: value})
    assert status == 400 and words in reply["error"]["message"] and reply["error"]["param"] == field, reply


@pytest.fixture(scope="module")
def busy_server(text_server):
    """One slot, taken (as a request under way takes it) while the tests run, and no queue."""
    srv, _ = make_server(text_server.model.path, parallel=1, max_queue=0)
    slot = srv.gate()
    slot.__enter__()
    yield srv
    slot.__exit__(None, None, None)
    srv.stop()


def raw_request(port, head: bytes, body: bytes = b"") -> bytes:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(head + body)
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    s.close()
    return out


def test_conflicting_content_length_is_400_and_closes(text_server):
    body = json.dumps({"messages": MSGS, "max_tokens": 1}).encode()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nContent-Length: 5\r\n\r\n" % len(body))
    reply = raw_request(text_server.server_address[1], head, body)  # returns: the server closed
    assert reply.startswith(b"HTTP/1.1 400") and b"conflicting Content-Length" in reply
    assert b"Connection: close" in reply and reply.count(b"HTTP/1.1") == 1  # the body was not run as a request


def test_repeated_equal_content_length_is_accepted(text_server):
    body = json.dumps({"messages": MSGS, "max_tokens": 1}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", text_server.server_address[1], timeout=30)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(len(body)))
    conn.putheader("Content-Length", str(len(body)))
    conn.endheaders(body)
    r = conn.getresponse()
    assert r.status == 200, r.read()


def test_content_length_with_chunked_is_refused_and_closes(text_server):
    body = json.dumps({"messages": MSGS}).encode()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\nContent-Length: %d\r\n\r\n" % len(body))
    reply = raw_request(text_server.server_address[1], head, b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 411") and b"Connection: close" in reply


def test_presence_and_frequency_penalties_reach_the_model(text_server):
    port = text_server.server_address[1]
    plain = post(port, {"messages": MSGS, "max_tokens": 12, "temperature": 0})[1]
    pen = post(port, {"messages": MSGS, "max_tokens": 12, "temperature": 0, "presence_penalty": 2,
                      "frequency_penalty": 2})[1]
    assert pen["choices"][0]["message"]["content"] != plain["choices"][0]["message"]["content"]


def test_head_answers_as_get_without_a_body(text_server):
    """HEAD (load balancers' and uptime checkers' probes) gets GET's status and headers, no body;
    the connection then serves the next request."""
    conn = http.client.HTTPConnection("127.0.0.1", text_server.server_address[1], timeout=10)
    for path, status in (("/health", 200), ("/v1/models", 200), ("/nowhere", 404)):
        conn.request("HEAD", path)
        r = conn.getresponse()
        assert r.status == status and r.read() == b"" and int(r.getheader("Content-Length")) > 0, path
    conn.request("GET", "/health")
    r = conn.getresponse()
    assert r.status == 200 and json.loads(r.read())
    conn.close()


@pytest.mark.parametrize("head, status", [
    (b"GET /health HTTP/1.1 extra\r\n\r\n", 400),                       # a malformed request line
    (b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", 414),              # a URL too long
    (b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(120)) + b"\r\n", 431),
    (b"BREW /health HTTP/1.1\r\nHost: x\r\n\r\n", 501),                 # a method nobody serves
])
def test_what_http_itself_refuses_is_a_json_error(text_server, head, status):
    reply = raw_request(text_server.server_address[1], head)
    first, _, rest = reply.partition(b"\r\n")
    assert first.startswith(b"HTTP/1.") and int(first.split()[1]) == status, reply[:200]
    headers, _, body = rest.partition(b"\r\n\r\n")
    assert b"Content-Type: application/json" in headers, headers
    err = json.loads(body)["error"]
    assert err["message"] and "\n" not in err["message"] and "<" not in err["message"], err
