"""``--image demo`` (run, chat) and ``/image demo`` (chat): a random demo scene saved as a file."""

from __future__ import annotations

import random
from pathlib import Path

from .scenes import make_scene


def save_demo_scene(out, seed: int | None = None):
    """(PIL image, path): a fresh demo scene (``seed`` None: a random one) saved to ``out``."""
    scene = make_scene(random.randrange(1 << 30) if seed is None else seed)
    out = Path(out)
    scene.image.save(out)
    return scene.image, out
