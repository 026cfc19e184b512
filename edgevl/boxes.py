"""Regions of the prompt's images that an answer names (grounding, detection), and drawing them.

The architecture's output processor (``Architecture.output_processor``) finds them in the
generated text and rescales them to original-image pixels; generation returns them with the
last event (``Event.boxes``) and ``edgevl.complete`` returns them with the text.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from PIL import Image, ImageDraw

COLORS = ["#e6194b", "#3cb44b", "#4363d8", "#f58231", "#911eb4", "#42d4f4", "#f032e6", "#bfef45"]


class Box(NamedTuple):
    """One box in pixels of the original image ``image`` (its index in the prompt, from 0);
    x1 <= x2 and y1 <= y2, inclusive pixel coordinates inside that image."""
    label: str | None
    x1: int
    y1: int
    x2: int
    y2: int
    image: int = 0

    @classmethod
    def of(cls, label, x1, y1, x2, y2, image: int = 0) -> Box:
        """A box from two corners in any order."""
        return cls(label, min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2), image)

    @property
    def xyxy(self) -> tuple[int, int, int, int]:
        return (self.x1, self.y1, self.x2, self.y2)

    def as_json(self) -> dict:
        return {"label": self.label, "box": list(self.xyxy), "image": self.image}


def draw_boxes(image: Image.Image, boxes: list, width: int | None = None) -> Image.Image:
    """A copy of ``image`` with ``boxes`` (Box tuples of this image) drawn and labelled."""
    im = image.convert("RGB").copy()
    d = ImageDraw.Draw(im)
    w = width or max(2, round(min(im.size) / 150))
    for i, b in enumerate(boxes):
        color = COLORS[i % len(COLORS)]
        d.rectangle(b.xyxy, outline=color, width=w)
        label = b.label or str(i + 1)
        x, y = b.x1, max(0, b.y1 - 12)
        tb = d.textbbox((x, y), label)
        d.rectangle(tb, fill=color)
        d.text((x, y), label, fill="white")
    return im


def box_image_paths(out, n_images: int) -> list[Path]:
    """Where ``--draw-boxes OUT`` writes each image: OUT itself for one image, else OUT-1, OUT-2 ..."""
    out = Path(out)
    if n_images == 1:
        return [out]
    return [out.with_name(f"{out.stem}-{k + 1}{out.suffix or '.png'}") for k in range(n_images)]
