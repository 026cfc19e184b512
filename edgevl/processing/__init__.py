"""Image and video preprocessing, and where a checkpoint keeps its processors' settings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..errors import EdgevlError
from ..tokenizer import read_json_object

# a processor's settings file -> its entry in processor_config.json, where transformers 5 saves
# every processor of a checkpoint together (and reads them first)
NESTED = {"preprocessor_config.json": "image_processor", "video_preprocessor_config.json": "video_processor"}


def settings(folder, name: str) -> tuple[dict, Path] | None:
    """A checkpoint's settings of one processor (``name``: the file it is saved as alone) and the
    file they came from, as transformers looks for them: the entry in processor_config.json,
    else the file itself; None where neither has them."""
    folder = Path(folder)
    p = folder / "processor_config.json"
    if p.is_file():
        v = read_json_object(p).get(NESTED[name])
        if v is not None:
            if not isinstance(v, dict):
                raise EdgevlError(f"{p}: {NESTED[name]} must be a JSON object, got a {type(v).__name__}; fix or "
                                  "re-download it")
            return v, p
    p = folder / name
    return (read_json_object(p), p) if p.is_file() else None


def write_settings(folder, out) -> None:
    """The checkpoint's processor settings into a package, one file each (what the runtime reads)."""
    folder, out = Path(folder), Path(out)
    for name in NESTED:
        got = settings(folder, name)
        if got is None:
            continue
        if got[1].name == name:
            shutil.copy2(got[1], out / name)
        else:
            (out / name).write_text(json.dumps(got[0], indent=2) + "\n")
