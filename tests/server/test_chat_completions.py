"""`edgevl serve`: a live server on a free loopback port, driven by the official openai client and raw HTTP."""

import base64
import http.client
import io
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from openai import OpenAI
from PIL import Image

import edgevl
from edgevl.generate import prepare
from edgevl.server import make_server
from support.youtu import make_youtu
from support.youtu_vl import make_vl

KEY = "test-key"
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How many shapes are there?"}]


@pytest.fixture(scope="module")
def pkgs(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    text = edgevl.convert(make_youtu(root / "ck", seed=5), root / "tiny-youtu", dtype="fp32", progress=False)
    vl_ck, _ = make_vl(root / "vl-ck", seed=6)
    vl = edgevl.convert(vl_ck, root / "tiny-vl", dtype="fp32", progress=False)
    images = root / "images"
    images.mkdir()
    picture(64, 48).save(images / "a.png")
    (root / "secret.png").write_bytes((images / "a.png").read_bytes())
    (images / "link.png").symlink_to(root / "secret.png")
    return root, text, vl


@pytest.fixture(scope="module")
def text_server(pkgs):
    srv, _ = make_server(pkgs[1], api_key=KEY, model_name="tiny", strict_model=True)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def vl_server(pkgs):
    srv, _ = make_server(pkgs[2], image_dir=pkgs[0] / "images", max_body=1 << 20)
    yield srv
    srv.stop()


def picture(w, h, seed=0):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def data_url(im):
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def client(srv, key=KEY):
    return OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0, timeout=60)


def reference(pkg, messages, n):
    """edgevl's own greedy answer, token list and prompt length on a fresh model."""
    model = edgevl.load(pkg)
    prep = prepare(model, messages)
    tokens = list(model.generate_tokens(prep.input_ids, n, image=prep.encoded, reuse_cache=False))
    return edgevl.generate(model, messages, max_new_tokens=n), tokens, len(prep.input_ids)


def raw(srv, method, path, body=None, headers=None, conn=None):
    conn = conn or http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=30)
    if isinstance(body, (dict, list)):
        body = json.dumps(body)
    h = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}", **(headers or {})}
    conn.request(method, path, body=body, headers={k: v for k, v in h.items() if v is not None})
    r = conn.getresponse()
    data = r.read()
    return r.status, (json.loads(data) if r.getheader("Content-Type") == "application/json" else data), conn


def good(srv, conn=None):
    status, body, _ = raw(srv, "POST", "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2}, conn=conn)
    assert status == 200, body
    assert body["choices"][0]["message"]["role"] == "assistant"


def test_text_matches_generate_stream_and_usage(pkgs, text_server):
    want, tokens, n_prompt = reference(pkgs[1], MSGS, 12)
    c = client(text_server)
    r = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason == ("stop" if tokens[-1] in edgevl.load(pkgs[1]).eos_ids else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        n_prompt, len(tokens), n_prompt + len(tokens))
    chunks = list(c.chat.completions.create(model="tiny-youtu", messages=MSGS, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == r.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(tokens)
    # the same conversation again: the whole prompt but its last token comes from the cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == n_prompt - 1
    assert [m.id for m in c.models.list()] == ["tiny"]
    assert c.models.list().data[0].max_model_len == edgevl.load(pkgs[1]).max_context


def test_stop_max_tokens_and_sampling_extensions(pkgs, text_server):
    want, tokens, _ = reference(pkgs[1], MSGS, 16)
    assert len(want) >= 4, want
    c = client(text_server)
    stop = want[len(want) // 2:len(want) // 2 + 2]
    r = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=16, stop=[stop, "\x00never"])
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (want[:want.find(stop)], "stop")
    r = c.chat.completions.create(model="tiny", messages=MSGS, max_completion_tokens=3)
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 3)
    # top_k=1 with a temperature is greedy again; extensions travel in the body
    r = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=16, temperature=0.8, seed=3,
                                  extra_body={"top_k": 1, "repetition_penalty": 1.0})
    assert r.choices[0].message.content == want
    # so is min_p=1 (only the likeliest tokens keep mass), at any temperature
    r = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=16, temperature=5.0, seed=4,
                                  extra_body={"min_p": 1.0})
    assert r.choices[0].message.content == want


def test_logprobs_plain_and_streamed(pkgs, text_server):
    """Each answer token's log-probability and its most likely alternatives, in OpenAI's shape;
    the stream carries the same entries on its chunks."""
    c = client(text_server)
    kw = dict(model="tiny", messages=MSGS, max_tokens=10, temperature=0, logprobs=True, top_logprobs=3)
    r = c.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens - (r.choices[0].finish_reason == "stop")   # not the end token
    for e in content:   # greedy: the token taken is the most likely one
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == e.logprob and e.top_logprobs[1].logprob <= e.logprob <= 0
    assert bytes(b for e in content for b in e.bytes).decode(errors="replace").startswith(r.choices[0].message.content)
    chunks = list(c.chat.completions.create(**kw, stream=True))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    # (the second request's prompt comes from the cache: the same numbers up to float rounding)
    assert [e.token for e in streamed] == [e.token for e in content]
    np.testing.assert_allclose([e.logprob for e in streamed], [e.logprob for e in content], rtol=0, atol=1e-4)
    # without them, none
    r = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4)
    assert r.choices[0].logprobs is None


def test_n_answers_decode_together_each_as_alone(pkgs, text_server):
    """n answers to one request: answer i is what a request of its own with seed + i gives (so
    sampled answers differ and each is reproducible), plain and streamed, and they decode
    together in the engine (its steps carry several rows)."""
    c = client(text_server)
    kw = dict(model="tiny", messages=MSGS, max_tokens=10, temperature=1.5, extra_body={"top_k": 0})
    alone = [c.chat.completions.create(**kw, seed=7 + i, logprobs=True).choices[0] for i in range(3)]
    assert len({a.message.content for a in alone}) > 1, "seeds 7-9 sampled one answer: the test proves nothing"
    engine = text_server.engine
    steps, rows = engine.steps, engine.rows
    r = c.chat.completions.create(**kw, seed=7, n=3, logprobs=True)
    assert engine.rows - rows > engine.steps - steps       # some steps decoded several answers at once
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert [ch.message.content for ch in r.choices] == [a.message.content for a in alone]
    assert [ch.finish_reason for ch in r.choices] == [a.finish_reason for a in alone]
    for ch, a in zip(r.choices, alone):
        np.testing.assert_allclose([e.logprob for e in ch.logprobs.content], [e.logprob for e in a.logprobs.content],
                                   rtol=0, atol=1e-4)
    made = sum(len(ch.logprobs.content) + (ch.finish_reason == "stop") for ch in r.choices)
    assert r.usage.completion_tokens == made and r.usage.total_tokens == r.usage.prompt_tokens + made
    chunks = list(c.chat.completions.create(**kw, seed=7, n=3, stream=True, stream_options={"include_usage": True}))
    for i, a in enumerate(alone):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == i]
        assert mine[0].delta.role == "assistant"
        assert "".join(m.delta.content or "" for m in mine) == a.message.content
        assert [m.finish_reason for m in mine if m.finish_reason] == [a.finish_reason]
    assert chunks[-1].usage.completion_tokens == made
    order = [ch.choices[0].index for ch in chunks if ch.choices]
    assert order != sorted(order), "the answers decode together: their chunks come as they are made"
    # greedy answers are all the greedy answer; the legacy endpoint takes n too
    r = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=8, temperature=0, n=2)
    assert r.choices[0].message.content == r.choices[1].message.content == reference(pkgs[1], MSGS, 8)[0]
    prompt = "<|begin_of_text|>The cat sat on"
    one = [c.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=1.5, seed=3 + i).choices[0].text
           for i in range(2)]
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=1.5, seed=3, n=2)
    assert [ch.text for ch in r.choices] == one and [ch.index for ch in r.choices] == [0, 1]
    chunks = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=1.5, seed=3, n=2,
                                       stream=True))
    assert ["".join(ch.choices[0].text for ch in chunks if ch.choices[0].index == i) for i in range(2)] == one
    # the Responses API gives one answer
    status, body, _ = raw(text_server, "POST", "/v1/responses", {"input": "hi", "n": 2})
    assert status == 400 and body["error"]["param"] == "n", body


def test_n_answers_beyond_the_slots_stream_from_the_first_token(pkgs):
    """With more answers than slots, the later answers wait for a slot; the stream still starts
    with the first answer's first token, not once every answer has begun."""
    srv, _ = make_server(pkgs[1], parallel=1)
    try:
        steps = srv.engine.steps
        conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=60)
        conn.request("POST", "/v1/chat/completions", json.dumps({"messages": MSGS, "max_tokens": 60, "n": 2,
                                                                 "stream": True, "temperature": 1.0, "seed": 2}),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        first = None
        for line in r:
            if line.startswith(b"data: {") and b'"content": "' in line and b'"content": ""' not in line:
                first = srv.engine.steps - steps
                break
        rest = r.read()
        conn.close()
        assert first is not None and first < 30, first     # the first answer alone is 60 steps
        assert rest.endswith(b"data: [DONE]\n\n") and b"\"index\": 1" in rest
    finally:
        srv.stop()


def test_n_answers_stop_when_the_client_hangs_up(text_server):
    """A streamed request of several answers whose client goes away: every answer stops, not
    only the one being sent."""
    s = socket.create_connection(("127.0.0.1", text_server.server_address[1]), timeout=30)
    body = json.dumps({"messages": MSGS, "max_tokens": 400, "stream": True, "n": 3, "temperature": 1.0,
                       "seed": 1}).encode()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    assert s.recv(100).startswith(b"HTTP/1.1 200")
    s.close()
    for _ in range(200):
        if not text_server.gate.locked() and not text_server.engine.active:
            break
        time.sleep(0.05)
    assert not text_server.engine.active and not text_server.engine.waiting
    assert max(len(slot.keys) for slot in text_server.engine.slots) < 200  # prompt + a few, not 400 more
    good(text_server)


def test_text_completions_continue_the_prompt_as_written(pkgs, text_server):
    """POST /v1/completions (the legacy endpoint older clients use): the prompt as it is, no
    template; OpenAI's default of 16 tokens; echo, stop, logprobs, streaming."""
    model = edgevl.load(pkgs[1])
    prompt = "<|begin_of_text|>The cat sat on"
    want = edgevl.generate(model, prompt, raw=True, max_new_tokens=16, temperature=0, reuse_cache=False)
    ids = model.tokenizer.encode(prompt)
    tokens = list(model.generate_tokens(ids, 16, reuse_cache=False))
    c = client(text_server)
    r = c.completions.create(model="tiny", prompt=prompt, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == want
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(tokens))
    assert r.choices[0].finish_reason == ("stop" if tokens[-1] in model.eos_ids else "length")
    chunks = list(c.completions.create(model="tiny", prompt=[prompt], temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
    assert chunks[-1].usage.completion_tokens == len(tokens)
    r = c.completions.create(model="tiny", prompt=prompt, temperature=0, echo=True, max_tokens=4)
    assert r.choices[0].text == prompt + edgevl.generate(model, prompt, raw=True, max_new_tokens=4, temperature=0)
    stop = want[len(want) // 2:len(want) // 2 + 2]
    r = c.completions.create(model="tiny", prompt=prompt, temperature=0, stop=stop)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want[:want.find(stop)], "stop")
    r = c.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=6, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens - (
        r.choices[0].finish_reason == "stop")
    # greedy: the token taken leads its alternatives (keyed by text, so tokens that read alike merge)
    assert all(1 <= len(d) <= 3 and max(d.values()) == v for d, v in zip(lp.top_logprobs, lp.token_logprobs))
    # where each token's text starts, in characters: as the stream's pieces put them
    chunks = list(c.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=6, logprobs=2,
                                       stream=True))
    assert lp.text_offset == [o for ch in chunks if ch.choices and ch.choices[0].logprobs
                              for o in ch.choices[0].logprobs.text_offset]
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(r.choices[0].text)


def test_tokenize_and_detokenize(pkgs, text_server):
    """llama-server's and vLLM's token endpoints: text as written, or messages as the chat
    endpoint renders them (the count is its prompt_tokens)."""
    tok = edgevl.load(pkgs[1]).tokenizer
    text = "The cat sat on the mat. <|end_of_text|> 你好"
    status, body, _ = raw(text_server, "POST", "/tokenize", {"content": text})
    assert status == 200 and body["tokens"] == tok.encode(text) and body["count"] == len(body["tokens"])
    assert raw(text_server, "POST", "/tokenize", {"prompt": text})[1]["tokens"] == body["tokens"]
    assert raw(text_server, "POST", "/detokenize", {"tokens": body["tokens"]})[1]["content"] == text
    pieces = raw(text_server, "POST", "/tokenize", {"content": "The cat", "with_pieces": True})[1]["tokens"]
    assert [p["id"] for p in pieces] == tok.encode("The cat") and "".join(p["piece"] for p in pieces) == "The cat"
    counted = raw(text_server, "POST", "/tokenize", {"messages": MSGS})[1]["count"]
    r = client(text_server).chat.completions.create(model="tiny", messages=MSGS, max_tokens=1)
    assert counted == r.usage.prompt_tokens
    for path, bad, msg in (("/tokenize", {}, "send one of content or prompt"),
                           ("/tokenize", {"content": "a", "prompt": "b"}, "send one of"),
                           ("/tokenize", {"content": 5}, "content must be a string"),
                           ("/tokenize", {"content": "word " * 20000}, "but this model's maximum context length is"),
                           ("/tokenize", {"messages": [{"role": "user", "content": [
                               {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, "takes text messages"),
                           ("/detokenize", {"tokens": [1, -2]}, "tokens must be a list of token ids"),
                           ("/detokenize", {"tokens": [tok.vocab_size]}, "tokens must be a list of token ids")):
        status, body, _ = raw(text_server, "POST", path, bad)
        assert status == 400 and msg in body["error"]["message"], (path, bad, body)


def test_logit_bias_forces_and_bans(pkgs, text_server):
    tok = edgevl.load(pkgs[1]).tokenizer
    a = tok.encode("a")[0]
    c = client(text_server)
    r = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=5, logit_bias={str(a): 100})
    assert r.choices[0].message.content == tok.decode([a] * 5)
    want, tokens, _ = reference(pkgs[1], MSGS, 6)
    r = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=6, temperature=0,
                                  logit_bias={str(t): -100 for t in tokens})
    assert r.choices[0].message.content != want


def test_image_data_url_matches_generate(pkgs, vl_server):
    im = picture(64, 48, seed=1)
    ours = [{"role": "user", "content": [{"type": "image", "image": im}, {"type": "text", "text": "What is it?"}]}]
    want, tokens, n_prompt = reference(pkgs[2], ours, 8)
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(im)}},
                                         {"type": "text", "text": "What is it?"}]}]
    c = client(vl_server, key="anything")  # no key configured: any is accepted
    r = c.chat.completions.create(model="tiny-vl", messages=msgs, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == want
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, len(tokens))
    chunks = list(c.chat.completions.create(model="tiny-vl", messages=msgs, max_tokens=8, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_local_image_paths(pkgs, vl_server):
    root = pkgs[0]

    def ask(url):
        msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "hi"}]}]
        return raw(vl_server, "POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 2})[:2]

    assert ask("a.png")[0] == 200
    assert ask(f"file://{root / 'images' / 'a.png'}")[0] == 200
    for url in ["../secret.png", str(root / "secret.png"), "link.png", f"file://{root}/images/../secret.png"]:
        status, body = ask(url)
        assert status == 403 and "outside the allowed" in body["error"]["message"], (url, body)
    status, body = ask("missing.png")
    assert status == 400 and "not found" in body["error"]["message"] and str(root) not in body["error"]["message"]
    for url in ("", "  "):    # an empty URL is the mistake, not the server's setting
        status, body = ask(url)
        assert status == 400 and "image_url.url must be a data: URL" in body["error"]["message"], (url, body)


def test_bad_requests_get_clear_errors_and_the_server_goes_on(pkgs, text_server, vl_server):
    def img(url):
        return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}

    cases = [  # (server, method, path, body, headers, status, words in the message)
        (text_server, "POST", "/v1/chat/completions", b'{"messages": [', {}, 400, "not valid JSON"),
        (text_server, "POST", "/v1/chat/completions", {"model": "gpt-4o", "messages": MSGS}, {}, 404, "gpt-4o"),
        (text_server, "POST", "/v1/chat/completions", {"messages": MSGS}, {"Content-Type": "text/plain"}, 415,
         "application/json"),
        (text_server, "POST", "/v1/chat/completions", {"messages": MSGS}, {"Authorization": "Bearer wrong"}, 401,
         "API key"),
        (text_server, "GET", "/v1/models", None, {"Authorization": None}, 401, "API key"),
        (text_server, "POST", "/v1/chat/completions", {"messages": []}, {}, 400, "messages"),
        (text_server, "POST", "/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, {}, 400,
         "role"),
        (text_server, "POST", "/v1/chat/completions", {"messages": MSGS, "temperature": "hot"}, {}, 400,
         "temperature"),
        (text_server, "POST", "/v1/chat/completions", {"messages": MSGS, "top_p": 0}, {}, 400, "top_p"),
        (text_server, "POST", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": "word " * 600}]}, {}, 400, "context length is 512"),
        (text_server, "POST", "/v1/chat/completions", img(data_url(picture(32, 32))), {}, 400, "no vision tower"),
        (text_server, "GET", "/v1/nope", None, {}, 404, "no route"),
        (text_server, "GET", "/v1/chat/completions", None, {}, 405, "takes POST"),
        (vl_server, "POST", "/v1/chat/completions", img("data:image/png;base64,@@not base64@@"), {}, 400, "base64"),
        (vl_server, "POST", "/v1/chat/completions", img("data:image/png;base64,aGVsbG8="), {}, 400,
         "not an image in a format"),
        (vl_server, "POST", "/v1/chat/completions", img("https://example.com/cat.png"), {}, 400, "not fetched"),
        (vl_server, "POST", "/v1/chat/completions", img("/etc/passwd"), {}, 403, "outside the allowed"),
    ]
    conns = {}
    for srv, method, path, body, headers, status, words in cases:
        got, reply, conns[srv] = raw(srv, method, path, body, headers, conn=conns.get(srv))
        assert got == status, (path, body, got, reply)
        err = reply["error"]
        assert set(err) == {"message", "type", "param", "code"} and words in err["message"], (words, err)
        assert "<_io." not in err["message"] and " object at 0x" not in err["message"], err
        good(srv, conn=conns[srv])  # the same keep-alive connection carries the next good request
    with pytest.raises(Exception, match="Error code: 403"):  # the openai client sees a clear error too
        client(vl_server).chat.completions.create(model="tiny-vl", **img("/etc/passwd"))


def test_any_model_name_unless_strict_and_model_name_sets_the_id(pkgs, vl_server, text_server):
    """OpenAI clients send fixed names: one model answers to any, unless --strict-model."""
    r = client(vl_server).chat.completions.create(model="gpt-4o-mini", messages=MSGS, max_tokens=2)
    assert r.choices[0].message.role == "assistant" and r.model == "tiny-vl"
    status, card, _ = raw(vl_server, "GET", "/v1/models/gpt-4o-mini")
    assert status == 200 and card["id"] == "tiny-vl"
    status, body, _ = raw(text_server, "POST", "/v1/chat/completions", {"model": "gpt-4o", "messages": MSGS})
    assert status == 404 and "'gpt-4o' does not exist; this server runs 'tiny'" in body["error"]["message"]
    assert [m.id for m in client(text_server).models.list().data] == ["tiny"]  # --model-name


def test_busy_port_error_names_the_port(pkgs, vl_server):
    from edgevl.errors import EdgevlError
    from edgevl.server import EdgevlServer

    port = vl_server.server_address[1]
    with pytest.raises(EdgevlError, match=f"port {port} on 127.0.0.1 is already in use.*--port"):
        EdgevlServer(vl_server.model, "127.0.0.1", port)


def test_image_pixel_budget(vl_server, monkeypatch):
    import edgevl.server

    monkeypatch.setattr(edgevl.server, "MAX_IMAGE_PIXELS", 5000)  # two 64x48 images: 6144 pixels
    part = {"type": "image_url", "image_url": {"url": data_url(picture(64, 48))}}
    status, body, _ = raw(vl_server, "POST", "/v1/chat/completions",
                          {"messages": [{"role": "user", "content": [part, part]}]})
    assert status == 400 and body["error"]["param"] == "messages[0].content[1]", body
    good(vl_server)


def test_oversized_body_is_refused_unread(vl_server):
    conn = http.client.HTTPConnection("127.0.0.1", vl_server.server_address[1], timeout=30)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(10 ** 9))
    conn.endheaders()
    conn.send(b'{"messages": "' + b"x" * 65536)
    r = conn.getresponse()
    msg = json.loads(r.read())["error"]["message"]
    assert r.status == 413 and "the limit is" in msg, msg
    assert ("paths under its allowed folder" in msg) == (vl_server.image_dir is not None), msg
    assert r.getheader("Connection") == "close"
    good(vl_server)


def test_client_disconnect_mid_stream(text_server):
    s = socket.create_connection(("127.0.0.1", text_server.server_address[1]), timeout=30)
    body = json.dumps({"messages": MSGS, "max_tokens": 400, "stream": True}).encode()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    assert s.recv(100).startswith(b"HTTP/1.1 200")
    s.close()
    for _ in range(200):  # the handler notices on its next write and gives the model back
        if not text_server.gate.locked():
            break
        time.sleep(0.05)
    assert max(len(slot.keys) for slot in text_server.engine.slots) < 200  # prompt + a few, not 400 more
    good(text_server)
    status, health, _ = raw(text_server, "GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["waiting"] == 0


@pytest.mark.parametrize("max_queue", [2, 8])
def test_load_50_requests_8_clients(pkgs, max_queue):
    srv, _ = make_server(pkgs[1], max_queue=max_queue)
    try:
        def one(i):
            t = time.perf_counter()
            conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=60)
            msgs = [{"role": "user", "content": f"Question {i}: how many shapes?"}]
            conn.request("POST", "/v1/chat/completions", json.dumps({"messages": msgs, "max_tokens": 8}),
                         {"Content-Type": "application/json"})
            r = conn.getresponse()
            body = json.loads(r.read())
            conn.close()
            return r.status, body, time.perf_counter() - t

        t0 = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(50)))
        wall = time.perf_counter() - t0
        statuses = [s for s, _, _ in results]
        assert set(statuses) <= {200, 429} and statuses.count(200) >= 3, statuses
        if max_queue >= 7:  # 1 running + 7 waiting: no client ever finds the queue full
            assert statuses.count(200) == 50
        for s, body, _ in results:
            assert ("choices" in body) if s == 200 else (body["error"]["type"] == "rate_limit_error")
        ok = np.array([t for s, _, t in results if s == 200]) * 1000
        p50, p95 = np.percentile(ok, [50, 95])
        print(f"\nload: 50 requests, 8 clients, max_queue={max_queue}, max_tokens=8: {statuses.count(200)} "
              f"answered, {statuses.count(429)} rejected (429) in {wall:.2f} s; answered latency p50 {p50:.0f} ms, "
              f"p95 {p95:.0f} ms")
        assert raw(srv, "GET", "/health")[1]["waiting"] == 0
        good(srv)
    finally:
        srv.stop()
