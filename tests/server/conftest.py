import pytest

import edgevl
from edgevl.demo import demo_package
from edgevl.server import make_server


@pytest.fixture(scope="module")
def server():
    """The demo model behind a server in this process (a queue of 4), per test module."""
    srv, _ = make_server(edgevl.load(demo_package()), max_queue=4)
    yield srv
    srv.stop()
