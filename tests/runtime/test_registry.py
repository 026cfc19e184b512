"""The family registry: a config resolves to its family, unknown ones are refused naming what is
supported, conversion options are checked, and an old package format asks to convert again."""

import json

import pytest

from edgevl import models
from edgevl.errors import EdgevlError
from edgevl.package import read_manifest


def test_registry_resolves_and_refuses():
    assert models.resolve({"model_type": "youtu"}).name == "youtu"
    assert models.resolve({"architectures": ["YoutuVLForConditionalGeneration"]}).name == "youtu_vl"
    assert models.get("youtu_vl").chat_template
    with pytest.raises(EdgevlError, match="not supported; edgevl converts: youtu"):
        models.resolve({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(EdgevlError, match="not known to this edgevl"):
        models.get("nonexistent")
    arch = models.get("youtu")
    assert arch.resolve_options({}) == {"kv_cache": "expanded"}
    with pytest.raises(EdgevlError, match="kv_cache must be one of"):
        arch.resolve_options({"kv_cache": "fancy"})
    with pytest.raises(EdgevlError, match="no conversion option 'colour'"):
        arch.resolve_options({"colour": "red"})


def test_old_package_format_refused_with_convert_again(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "edgevl-package", "format_version": 1,
                                                        "source": {"path": "/models/x"}}))
    with pytest.raises(EdgevlError, match=r"older edgevl .*convert it again: edgevl convert /models/x"):
        read_manifest(tmp_path)
