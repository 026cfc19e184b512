"""GET /metrics: Prometheus's text format behind the API key, whose counts are what the answers
reported in their usage; a client that hangs up counts as a cancelled answer."""

import http.client
import math
import re
from collections import Counter

import pytest
from openai import OpenAI

import edgevl
from edgevl.demo import demo_package
from edgevl.metrics import Registry
from edgevl.server import make_server
from support.server import MSGS, post, send_raw, wait_for

KEY = "metrics-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@pytest.fixture(scope="module")
def srv():
    """The demo model with no end-of-text (answers run to max_tokens, or on until the client
    goes), two slots."""
    model = edgevl.load(demo_package())
    model.eos_ids = set()
    srv, _ = make_server(model, api_key=KEY, max_queue=4, parallel=2)
    yield srv
    srv.stop()


def scrape(port, headers=AUTH):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics", headers=headers)
    r = conn.getresponse()
    body = r.read().decode()
    conn.close()
    return r.status, r.getheader("Content-Type"), body


def parse(text: str) -> dict:
    """{(name, ((label, value), ...)): number}, checking the format on the way: every sample's
    family declared by HELP and TYPE before it, histogram buckets cumulative up to +Inf = count."""
    declared, kinds, out = set(), {}, {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            declared.add(line.split()[2])
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert name in declared and kind in ("counter", "gauge", "histogram"), line
            kinds[name] = kind
            continue
        m = SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in kinds else name
        assert family in kinds, f"{name} has no TYPE line before it"
        out[(name, tuple(LABEL.findall(labels)))] = value
    for name, kind in kinds.items():
        if kind != "histogram":
            continue
        buckets = [(float(dict(k[1])["le"].replace("+Inf", "inf")), v) for k, v in out.items()
                   if k[0] == f"{name}_bucket"]
        bounds = [b for b, _ in buckets]
        assert bounds == sorted(bounds) and bounds[-1] == math.inf, name
        counts = [v for _, v in buckets]
        assert counts == sorted(counts) and counts[-1] == out[(f"{name}_count", ())], name
    return out


def test_metrics_count_what_the_answers_reported(srv):
    port = srv.server_address[1]
    status, ctype, text = scrape(port)
    assert status == 200 and ctype.startswith("text/plain; version=0.0.4")
    before = parse(text)
    usages, reasons = [], Counter()
    for body in ({"messages": MSGS, "max_tokens": 5},
                 {"messages": MSGS, "max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 3}):
        status, reply, _ = post(port, body, headers=AUTH)
        assert status == 200, reply
        usages.append(reply["usage"])
        reasons.update(c["finish_reason"] for c in reply["choices"])
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY)
    chunks = list(client.chat.completions.create(model="demo", messages=MSGS, max_tokens=6, stream=True,
                                                 stream_options={"include_usage": True}))
    usages.append(chunks[-1].usage.model_dump())
    reasons.update(c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason)
    status, _, _ = post(port, {"messages": []}, headers=AUTH)     # refused: no answer runs
    assert status == 400
    after = parse(scrape(port)[2])

    def grew(name, **labels):
        key = (name, tuple(labels.items()))
        return after[key] - before.get(key, 0)

    assert grew("edgevl_generation_tokens_total") == sum(u["completion_tokens"] for u in usages) == 5 + 8 + 6
    assert grew("edgevl_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)   # once per request
    assert grew("edgevl_prompt_tokens_cached_total") == sum(u["prompt_tokens_details"]["cached_tokens"]
                                                            for u in usages)
    assert grew("edgevl_http_requests_total", route="/v1/chat/completions", status="200") == 3
    assert grew("edgevl_http_requests_total", route="/v1/chat/completions", status="400") == 1
    assert reasons == {"length": 4}
    assert grew("edgevl_answers_total", finish_reason="length") == 4
    for h in ("edgevl_time_to_first_token_seconds", "edgevl_request_duration_seconds",
              "edgevl_time_per_output_token_seconds"):
        assert grew(f"{h}_count") == 3, h       # a request's latencies, whatever its n
    assert 0 < grew("edgevl_time_to_first_token_seconds_sum") < grew("edgevl_request_duration_seconds_sum")
    decode = grew("edgevl_engine_forwards_total", kind="decode")
    assert decode > 0 and grew("edgevl_engine_decode_rows_total") >= decode
    assert after[("edgevl_requests_running", ())] == 0 and after[("edgevl_slots", ())] == 2
    assert after[("process_resident_memory_bytes", ())] > 10 << 20


def test_metrics_need_the_api_key(srv):
    port = srv.server_address[1]
    assert scrape(port, headers={})[0] == 401
    assert scrape(port, headers={"Authorization": "Bearer wrong"})[0] == 401


def test_a_client_that_hangs_up_counts_as_cancelled(srv):
    port = srv.server_address[1]
    before = parse(scrape(port)[2])
    s = send_raw(port, {"messages": MSGS}, AUTH)   # no max_tokens, no end-of-text: runs until stopped
    assert wait_for(srv.gate.locked, 10) is not None
    s.close()
    assert wait_for(lambda: not srv.gate.locked(), 5) is not None
    after = parse(scrape(port)[2])
    key = ("edgevl_answers_total", (("finish_reason", "cancelled"),))
    assert after[key] - before.get(key, 0) == 1


def test_registry_writes_prometheus_text():
    reg = Registry()
    reg.add("t_total", "A counter.", labels=("what",))
    reg.add("t_seconds", "A histogram.", "histogram", buckets=(0.1, 1))
    reg.inc("t_total", 2, what='a "quoted"\\ value\nwith a newline')
    for v in (0.1, 0.5, 3):     # a bound is inclusive (le): 0.1 counts in the 0.1 bucket
        reg.observe("t_seconds", v)
    out = parse(reg.render())
    assert out[("t_total", (("what", 'a \\"quoted\\"\\\\ value\\nwith a newline'),))] == 2
    assert [out[("t_seconds_bucket", (("le", le),))] for le in ("0.1", "1", "+Inf")] == [1, 2, 3]
    assert out[("t_seconds_sum", ())] == pytest.approx(3.6) and out[("t_seconds_count", ())] == 3
    with pytest.raises(ValueError, match="takes the labels"):
        reg.inc("t_total", 1)


def test_the_access_log_has_each_requests_time_tokens_and_id(capfd):
    """`edgevl serve`'s log: a line per request once it is over, with its status, its time, for an
    answer the tokens its usage reports, and the request's id: a gateway's X-Request-Id (visible
    ASCII, up to 128 characters), else one of the server's, also sent back in that header."""
    srv, _ = make_server(edgevl.load(demo_package()), access_log=True)
    try:
        port = srv.server_address[1]
        status, reply, r = post(port, {"messages": MSGS, "max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 1},
                                headers={"X-Request-Id": "trace-7f3a"})
        assert status == 200 and r.getheader("X-Request-Id") == "trace-7f3a"
        status, _, r = post(port, {"messages": []}, headers={"X-Request-Id": "has spaces"})
        assert status == 400
        ours = r.getheader("X-Request-Id")
        assert re.fullmatch(r"req_[0-9a-f]{32}", ours)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("HEAD", "/health")
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        srv.stop()
    log = capfd.readouterr().err
    u = reply["usage"]
    line = (f'"POST /v1/chat/completions" 200 in \\d+\\.\\d{{3}} s, {u["prompt_tokens"]} prompt tokens '
            f'\\({u["prompt_tokens_details"]["cached_tokens"]} cached\\), {u["completion_tokens"]} generated '
            r'\[trace-7f3a\]\n')
    assert re.search(line, log), log
    assert re.search(r'"POST /v1/chat/completions" 400 in \d+\.\d{3} s \[' + ours + r'\]\n', log), log
    assert log.count('"POST /v1/chat/completions"') == 2       # once each, when it is over
    assert '"HEAD /health" 200' in log and '"GET /health"' not in log, log   # served as GET, logged as asked


def test_max_tokens_caps_every_answer():
    """`edgevl serve --max-tokens N`: a request that gives none gets N; one that asks for more is
    cut at N (finish_reason "length"); one that asks for fewer gets what it asked."""
    model = edgevl.load(demo_package())
    model.eos_ids = set()       # answers would run on: only the limits end them
    srv, _ = make_server(model, max_tokens=5)
    try:
        port = srv.server_address[1]
        for asked, got in ((None, 5), (100, 5), (3, 3)):
            body = {"messages": MSGS} | ({} if asked is None else {"max_tokens": asked})
            status, reply, _ = post(port, body)
            assert status == 200 and reply["usage"]["completion_tokens"] == got, (asked, reply)
            assert reply["choices"][0]["finish_reason"] == "length"
        status, reply, _ = post(port, {"prompt": "Once", "max_tokens": 50}, path="/v1/completions")
        assert status == 200 and reply["usage"]["completion_tokens"] == 5
    finally:
        srv.stop()


def test_failed_answers_are_refused_or_errors_by_whose_fault(srv, monkeypatch):
    """An answer that fails once it runs counts as `refused` when the request was at fault (its
    status a 400) and as `error` when the server was (a 500)."""
    from edgevl.errors import EdgevlError, PackageError

    port = srv.server_address[1]
    before = parse(scrape(port)[2])
    for fault, status in ((EdgevlError("this request cannot run"), 400), (PackageError("the package broke"), 500)):
        def forward(*a, fault=fault, **k):
            raise fault
        monkeypatch.setattr(srv.model.decoder, "forward", forward)
        assert post(port, {"messages": MSGS, "max_tokens": 3}, headers=AUTH)[0] == status
        monkeypatch.undo()
    after = parse(scrape(port)[2])
    for reason in ("refused", "error"):
        key = ("edgevl_answers_total", (("finish_reason", reason),))
        assert after[key] - before.get(key, 0) == 1, reason


def test_a_picture_sent_again_is_not_encoded_again():
    """A chat client sends the whole conversation every turn, its image included: the server
    encodes the picture once (the image cache's hits and misses in /metrics), and the second
    question's answer is the one a server without the cache gives. The start-up memory line
    counts the cache's budget."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    from edgevl.server import memory_line

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(7).integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

    def turn(q):
        return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                          {"type": "text", "text": q}]}], "max_tokens": 6}

    answers = {}
    for mb in (0, 64):
        srv, _ = make_server(edgevl.load(demo_package(), image_cache_mb=mb), api_key=KEY)
        try:
            port = srv.server_address[1]
            got = []
            for q in ("What shapes are there?", "What colour is the circle?"):
                status, reply, _ = post(port, turn(q), headers=AUTH)
                assert status == 200, reply
                got.append(reply["choices"][0]["message"]["content"])
            answers[mb] = got
            m = parse(scrape(port)[2])
            counts = [m[("edgevl_image_cache_requests_total", (("result", r),))] for r in ("hit", "miss")]
            assert counts == ([0, 2] if mb == 0 else [1, 1]), (mb, counts)
            assert (m[("edgevl_image_cache_bytes", ())] > 0) == (mb > 0)
            assert ("64 MB of encoded images (--image-cache-mb)" in memory_line(srv)) == (mb > 0)
        finally:
            srv.stop()
    assert answers[64] == answers[0]
