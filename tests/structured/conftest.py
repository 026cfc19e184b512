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
def qwen(qwen_package):
    return edgevl.load(qwen_package)


@pytest.fixture(scope="session")
def qwen_plain(qwen_package):
    return edgevl.load(qwen_package, speculative="none")
