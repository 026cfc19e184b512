import pytest

import edgevl
from support.qwen import make_qwen3_5


@pytest.fixture(scope="session")
def qwen_package(tmp_path_factory):
    """A random tiny Qwen3.5 (the real chat template, thinking markers, tools section) with an
    MTP block, converted: it writes no JSON on its own, so a valid answer proves the constraint."""
    root = tmp_path_factory.mktemp("structured")
    return edgevl.convert(make_qwen3_5(root / "ck", seed=5, mtp=True, text_only=True), root / "pk", dtype="fp32",
                          progress=False)


@pytest.fixture(scope="session")
def qwen_vl_package(tmp_path_factory):
    """The same family with its vision tower (batch takes images)."""
    root = tmp_path_factory.mktemp("structured-vl")
    return edgevl.convert(make_qwen3_5(root / "ck", seed=6), root / "pk", dtype="fp32", progress=False)


@pytest.fixture(scope="session")
def qwen(qwen_package):
    return edgevl.load(qwen_package)


@pytest.fixture(scope="session")
def qwen_plain(qwen_package):
    return edgevl.load(qwen_package, speculative="none")


@pytest.fixture(scope="module")
def server(qwen_package):
    """The random Qwen3.5 behind a server in this process, thinking off by default."""
    from edgevl.server import make_server

    srv, _ = make_server(edgevl.load(qwen_package), max_queue=4, thinking=False)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
