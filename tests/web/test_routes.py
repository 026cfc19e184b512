"""The page's routes without a browser: `edgevl serve` prints the page's address; `/` and its files
load without the API key while `/props` and the API need it; only the page's own files are served,
with a policy that keeps the page to this server; `/props` says what the model takes."""

import http.client
import json
import subprocess
import sys

from edgevl.demo import demo_package


def get(srv, path, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=30)
    conn.request("GET", path, headers=headers or {})
    r = conn.getresponse()
    body = r.read()
    conn.close()
    return r.status, r.getheader("Content-Type"), body, r


def test_serve_prints_the_page_address_and_serves_it():
    demo_package()  # converted once, in this process's cache, which the command shares
    p = subprocess.Popen([sys.executable, "-m", "edgevl", "serve", "--port", "0", "--threads", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        lines = []
        for line in p.stdout:
            lines.append(line)
            if "chat page at" in line:
                break
        assert lines and lines[-1].startswith("edgevl: chat page at http://127.0.0.1:"), lines
        url = lines[-1].split(" at ", 1)[1].strip()
        assert url.endswith("/") and lines[-2].startswith("edgevl: serving demo at " + url[:-1] + "/v1")
        host, port = url[len("http://"):-1].split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("GET", "/")
        r = conn.getresponse()
        assert r.status == 200 and b'<script src="web/app.js"' in r.read()
    finally:
        p.terminate()
        p.wait(10)


def test_page_files_are_open_and_the_api_stays_closed(demo_model, start_server):
    srv = start_server(demo_model, api_key="s3cret")
    status, ctype, body, r = get(srv, "/")
    assert status == 200 and ctype == "text/html; charset=utf-8" and body.startswith(b"<!doctype html>")
    policy = r.getheader("Content-Security-Policy")
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy and "script-src 'self'" in policy
    for name, kind in (("app.js", "text/javascript"), ("markdown.js", "text/javascript"), ("style.css", "text/css"),
                       ("icon.svg", "image/svg+xml")):
        status, ctype, body, _ = get(srv, "/web/" + name)
        assert status == 200 and ctype.startswith(kind) and body, name
    for path in ("/props", "/v1/models"):
        status, _, body, _ = get(srv, path)
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key", path
    status, _, body, _ = get(srv, "/props", {"Authorization": "Bearer s3cret"})
    assert status == 200 and json.loads(body)["model"] == srv.model_id


def test_only_the_page_files_are_served(demo, tmp_path):
    for path in ("/web/__init__.py", "/web/../server.py", "/web/%2e%2e/server.py", "/web/..%2fserver.py",
                 "/web/missing.js", "/web/", "/web//etc/passwd", "/index.htm"):
        status, _, body, _ = get(demo, path)
        assert status == 404, (path, body)
        msg = json.loads(body)["error"]["message"]
        assert "\n" not in msg and ("open / for the page" in msg or "chat page at /" in msg), (path, msg)
    status, _, body, _ = get(demo, "/web/app.js")
    assert status == 200
    from edgevl.web import FOLDER

    assert body == (FOLDER / "app.js").read_bytes()


def test_props_say_what_the_model_takes(demo):
    status, _, body, _ = get(demo, "/props")
    p = json.loads(body)
    assert status == 200
    assert (p["model"], p["family"], p["context"], p["images"], p["video"], p["needs_image"], p["tools"]) == (
        demo.model_id, "youtu_vl", demo.model.max_context, True, False, True, False)
    assert p["thinking"] == {"reasoning": False, "switch": False, "default": None, "on": {}, "off": {}}
    assert p["speculative"] == "none" and p["max_body"] == demo.max_body
    assert p["defaults"]["temperature"] == 0.0 and p["defaults"]["max_tokens"] is None


FETCH = """
const [url, done] = arguments;
fetch(url + "/v1/chat/completions", {method: "POST", headers: {"Content-Type": "application/json",
      "Authorization": "Bearer k"}, body: JSON.stringify({messages: [{role: "user", content: "Describe the image."}],
      max_tokens: 3})})
  .then((r) => r.json()).then((j) => done("answer: " + j.choices[0].message.content), (e) => done("error: " + e));
"""


def test_a_web_app_on_another_origin_calls_the_api_only_where_allowed(demo_model, start_server, driver):
    """A real browser, from a page on one origin, calls servers on others: the one that names the
    page's origin in --allow-origin answers; the one that names none is blocked by the browser."""
    # a document of the app's origin: this server's /health (the chat page's policy would keep its
    # fetches to its own server)
    page = start_server(demo_model)
    allowed = start_server(demo_model, api_key="k", allow_origins=[page.url])
    closed = start_server(demo_model, api_key="k")
    driver.get(page.url + "/health")
    driver.set_script_timeout(60)
    assert driver.execute_async_script(FETCH, allowed.url).startswith("answer: ")
    assert driver.execute_async_script(FETCH, closed.url).startswith("error: TypeError")
