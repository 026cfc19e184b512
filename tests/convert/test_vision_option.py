"""``convert --vision q8|float`` sets the vision tower's precision: on a checkpoint without a tower
every family refuses it alike, with one line and nothing written; ``--vision auto`` (what any
checkpoint gets) converts."""

import pytest

import edgevl
from edgevl.errors import EdgevlError
from support.cli import cli, one_line_error
from support.convert import left_over
from support.files import package_digest
from support.qwen import make_qwen3_5

WORDS = ("has no vision tower", "leave --vision out")


@pytest.fixture(scope="module")
def text_only(tmp_path_factory, tiny):
    """Text-only checkpoints: a Qwen3.5 (a family whose tower is optional) and a Youtu-LLM (one
    that never has a tower), with their default packages."""
    root = tmp_path_factory.mktemp("text-only")
    qwen = make_qwen3_5(root / "qwen", text_only=True)
    return {"qwen3_5": (qwen, edgevl.convert(qwen, root / "qwen-pk", dtype="q8", progress=False)),
            "youtu": (tiny[0], edgevl.convert(tiny[0], root / "youtu-pk", dtype="q8", progress=False))}


@pytest.mark.parametrize("family", ["qwen3_5", "youtu"])
@pytest.mark.parametrize("value", ["q8", "float"])
def test_vision_precision_on_a_checkpoint_without_a_tower_is_refused(text_only, family, value, tmp_path, capsys):
    ck, _ = text_only[family]
    code, _, err = cli(capsys, "convert", ck, tmp_path / "out", "--dtype", "q8", "--vision", value, "--quiet")
    one_line_error(code, err, f"--vision {value}", *WORDS)
    with pytest.raises(EdgevlError, match="has no vision tower"):
        edgevl.convert(ck, tmp_path / "out", dtype="q8", vision=value, progress=False)
    assert not (tmp_path / "out").exists() and left_over(tmp_path, "out") == []


@pytest.mark.parametrize("family", ["qwen3_5", "youtu"])
def test_vision_auto_on_a_checkpoint_without_a_tower_converts(text_only, family, tmp_path, capsys):
    ck, default = text_only[family]
    code, _, err = cli(capsys, "convert", ck, tmp_path / "out", "--dtype", "q8", "--vision", "auto", "--quiet")
    assert code == 0, err
    assert package_digest(tmp_path / "out")["decoder.bin"] == package_digest(default)["decoder.bin"]
