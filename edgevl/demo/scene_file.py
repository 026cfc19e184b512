"""``--image demo`` (run, verify, chat) and ``/image demo`` (chat): a random demo scene saved as a file."""

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


def is_demo_image(image) -> bool:
    """``demo`` asks for a demo scene, unless a file of that name is there (then it is that file)."""
    return image == "demo" and not Path("demo").is_file()


def demo_images(images, seed: int | None = None, out=None, first: int = 0) -> tuple[list, list]:
    """(images, saved paths): ``images`` with each ``demo`` replaced by the path of a fresh demo
    scene. Every command resolves them here, so one ``--seed`` draws the same scenes in run,
    verify and chat: image ``first + k`` of a command (counted over all its images) gets scene
    ``seed + first + k``, a random one without a seed. Scenes are saved to ``out`` (default
    demo_scene.png), or OUT-1.png, OUT-2.png ... (by image position) when there are several."""
    images = list(images)
    saved = []
    for k, path in demo_paths(images, out, first).items():
        _, path = save_demo_scene(path, None if seed is None else seed + first + k)
        images[k] = str(path)
        saved.append(path)
    return images, saved


def demo_paths(images, out=None, first: int = 0) -> dict:
    """Where ``demo_images`` saves each ``demo`` of ``images`` (by position)."""
    out = Path(out or "demo_scene.png")
    demos = [k for k, im in enumerate(images) if is_demo_image(im)]
    if len(demos) == 1:
        return {demos[0]: out}
    return {k: out.with_name(f"{out.stem}-{first + k + 1}{out.suffix or '.png'}") for k in demos}
