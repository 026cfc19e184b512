import pytest

import edgevl
from edgevl.demo import demo_package
from edgevl.server import make_server
from support.web import browser, requested_urls

# every URL the browser may request: the servers under test, and the user's own files (data:, blob:)
LOCAL = ["data:", "blob:"]


@pytest.fixture(scope="session")
def driver():
    """One headless Chromium for every web test (starting one takes a second or two)."""
    try:
        d = browser()
    except RuntimeError as e:  # CI installs Chromium: a missing one is a failure, not a skip
        pytest.fail(str(e), pytrace=False)
    yield d
    d.quit()


@pytest.fixture(scope="session")
def demo_model():
    return edgevl.load(demo_package())


@pytest.fixture(scope="session")
def demo(demo_model):
    srv = _servers()[0](demo_model)
    yield srv
    srv.stop()


def _servers():
    started = []

    def start(model, **options):
        srv, _ = make_server(model, **options)
        LOCAL.append(srv.url + "/")
        started.append(srv)
        return srv

    return start, started


@pytest.fixture
def start_server():
    """Start servers for one test (stopped after it); the browser may request them."""
    start, started = _servers()
    yield start
    for srv in started:
        srv.stop()


@pytest.fixture(scope="module")
def module_servers():
    """Start servers for a test module."""
    start, started = _servers()
    yield start
    for srv in started:
        srv.stop()


@pytest.fixture(autouse=True)
def nothing_from_outside(request):
    """After each test: the browser requested nothing but the servers and the user's own files."""
    yield
    if "driver" in request.fixturenames:
        urls = requested_urls(request.getfixturevalue("driver"))
        outside = [u for u in urls if not any(u.startswith(p) for p in LOCAL)]
        assert not outside, f"the page requested URLs outside this machine's server: {outside[:5]}"
