import pytest

import edgevl
from support.youtu import tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint, its fp32 package) of the smallest Youtu-LLM, per test module."""
    root = tmp_path_factory.mktemp("hostile-convert")
    ck = tiny_checkpoint(root / "ck")
    ref = edgevl.convert(ck, root / "ref", dtype="fp32", progress=False)
    return ck, ref
