"""API keys: several at once (one per app, each revocable alone), from a file that keeps them out
of the process list, or from EDGEVL_API_KEY; every mistake in them is one line before the model
loads."""

import http.client

import pytest

import edgevl
from edgevl.demo import demo_package
from edgevl.errors import EdgevlError
from edgevl.server import api_keys_from, make_server
from support.cli import cli, one_line_error


def status_with(srv, key):
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=30)
    conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {})
    r = conn.getresponse()
    r.read()
    conn.close()
    return r.status


def test_any_of_several_keys_is_accepted_and_no_other():
    srv, _ = make_server(edgevl.load(demo_package()), api_key=["app-one", "app-two"])
    try:
        assert [status_with(srv, k) for k in ("app-one", "app-two", "app-three", "app-on", None)] == \
            [200, 200, 401, 401, 401]
    finally:
        srv.stop()


def test_keys_from_flags_a_file_or_the_environment(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# the gateway's apps\napp-one\n\n  app-two  \n")
    assert api_keys_from(["flag"], f, "env") == ["flag", "app-one", "app-two"]
    assert api_keys_from(None, None, "env") == ["env"]          # only when no flag gives one
    assert api_keys_from(None, None, None) == []
    (tmp_path / "empty").write_text("# nothing yet\n")
    for args, says in (((None, tmp_path / "missing", None), "cannot read --api-key-file"),
                       ((None, tmp_path / "empty", None), "holds no key"),
                       ((["two words"], None, None), "may not hold spaces")):
        with pytest.raises(EdgevlError, match=says):
            api_keys_from(*args)


def test_a_bad_key_file_is_one_line_before_loading(capsys, tmp_path):
    one_line_error(*cli(capsys, "serve", tmp_path / "nothing", "--api-key-file", tmp_path / "missing",
                        "--port", "0")[::2], "cannot read --api-key-file")
