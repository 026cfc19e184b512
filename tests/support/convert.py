"""Checkpoint copies for conversion tests, and what a refused conversion must leave behind."""

from __future__ import annotations

import shutil
from pathlib import Path

from support.cli import cli, one_line_error


def copy_ck(ck, dest) -> Path:
    shutil.copytree(ck, dest)
    return dest


def demo_copy(folder) -> Path:
    """The demo checkpoint (a Youtu-VL) with its small files copied and its weights linked."""
    from edgevl.demo import demo_checkpoint

    folder.mkdir()
    for f in demo_checkpoint().iterdir():
        if f.name == "model.safetensors":
            (folder / f.name).symlink_to(f)
        else:
            shutil.copy(f, folder / f.name)
    return folder


def left_over(parent, name):
    """Hidden work folders of conversions into parent/name."""
    return sorted(p.name for p in Path(parent).iterdir() if p.name.startswith(f".{name}."))


def refused_before_writing(capsys, ck, tmp_path, *needles):
    """``edgevl convert ck tmp_path/out`` fails with one line naming every needle, and writes nothing."""
    one_line_error(*cli(capsys, "convert", ck, tmp_path / "out", "--quiet")[::2], *needles)
    assert not (tmp_path / "out").exists() and left_over(tmp_path, "out") == []
