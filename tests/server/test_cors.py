"""Web apps on other origins (CORS): off unless --allow-origin names the app's origin (or '*');
then preflights pass and every answer, errors and streams included, carries the header the
browser checks. A real browser's view of it is in tests/web/test_routes.py."""

import http.client
import json

import pytest

import edgevl
from edgevl.demo import demo_package
from edgevl.errors import EdgevlError
from edgevl.server import make_server

KEY = "cors-key"
APP = "http://app.example:3000"


@pytest.fixture(scope="module")
def model():
    return edgevl.load(demo_package())


@pytest.fixture(scope="module")
def servers(model):
    """Servers with no --allow-origin, with the app's origin, and with '*'."""
    made = [make_server(model, api_key=KEY, allow_origins=o)[0] for o in (None, [APP + "/"], ["*"])]
    yield made
    for s in made:
        s.stop()


def call(srv, method, path, headers, body=None):
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=60)
    conn.request(method, path, json.dumps(body) if body is not None else None, headers)
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, r.headers, data


def preflight(srv, origin):
    return call(srv, "OPTIONS", "/v1/chat/completions", {"Origin": origin, "Access-Control-Request-Method": "POST",
                                                        "Access-Control-Request-Headers": "authorization,content-type"})


def chat(srv, origin, key=KEY, stream=False):
    headers = {"Content-Type": "application/json", "Origin": origin}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return call(srv, "POST", "/v1/chat/completions", headers,
                {"messages": [{"role": "user", "content": "Describe the image."}], "max_tokens": 3, "stream": stream})


def test_an_allowed_origin_passes_preflight_and_reads_every_answer(servers):
    _, app, _ = servers
    status, headers, _ = preflight(app, APP)
    assert status == 204 and headers["Access-Control-Allow-Origin"] == APP
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert headers["Access-Control-Allow-Headers"] == "authorization,content-type" and headers["Vary"] == "Origin"
    for stream in (False, True):
        status, headers, body = chat(app, APP, stream=stream)
        assert status == 200 and headers["Access-Control-Allow-Origin"] == APP, body
    status, headers, body = chat(app, APP, key=None)       # the page can read why it failed
    assert status == 401 and headers["Access-Control-Allow-Origin"] == APP


def test_other_origins_get_nothing_to_read(servers):
    closed, app, _ = servers
    for srv, origin in ((closed, APP), (app, "http://evil.example")):
        status, headers, body = preflight(srv, origin)
        assert status == 403 and "Access-Control-Allow-Origin" not in headers
        assert f"start it with --allow-origin {origin}" in json.loads(body)["error"]["message"]
        status, headers, _ = chat(srv, origin)
        assert status == 200 and "Access-Control-Allow-Origin" not in headers    # the browser hides it
    status, headers, _ = call(closed, "OPTIONS", "/v1/models", {})               # not a preflight
    assert status == 405


def test_any_origin_with_a_star(servers):
    _, _, star = servers
    for origin in (APP, "http://localhost:5173"):
        assert preflight(star, origin)[1]["Access-Control-Allow-Origin"] == "*"
        assert chat(star, origin)[1]["Access-Control-Allow-Origin"] == "*"


@pytest.mark.parametrize("bad", ["localhost:3000", "http://app.example/page", "ftp://x.example", "http://"])
def test_a_bad_origin_is_a_one_line_error(model, bad):
    with pytest.raises(EdgevlError, match=r"--allow-origin takes an origin such as http://localhost:3000"):
        make_server(model, allow_origins=[bad])
