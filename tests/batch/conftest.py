import pytest

import edgevl
from edgevl.demo import demo_package


@pytest.fixture(scope="module")
def pkg():
    """The demo package (converted once into the test cache)."""
    return demo_package()


@pytest.fixture(scope="module")
def model(pkg):
    return edgevl.load(pkg, threads=1)
