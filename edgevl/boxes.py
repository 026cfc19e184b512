"""Grounding answers: parse ``<box><x_a><y_b><x_c><y_d></box>`` and draw the boxes on the image.

Coordinates in generated text are already in original-image pixels (generation rescales the
coordinate tokens, spec youtu_vl.md §10.3).
"""

from __future__ import annotations

import re

from PIL import Image, ImageDraw

BOX_RE = re.compile(r"<box>\s*<x_(\d+)>\s*<y_(\d+)>\s*<x_(\d+)>\s*<y_(\d+)>\s*</box>")
REF_BOX_RE = re.compile(r"(?:<ref>(.*?)</ref>\s*)?" + BOX_RE.pattern)
COLORS = ["#e6194b", "#3cb44b", "#4363d8", "#f58231", "#911eb4", "#42d4f4", "#f032e6", "#bfef45"]


def parse_boxes(text: str) -> list[dict]:
    """[{'box': (x1, y1, x2, y2), 'label': str | None}, ...] in reading order."""
    out = []
    for m in REF_BOX_RE.finditer(text):
        x1, y1, x2, y2 = (int(v) for v in m.groups()[1:])
        out.append({"box": (min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2)),
                    "label": m.group(1).strip() if m.group(1) else None})
    return out


def draw_boxes(image: Image.Image, boxes: list[dict], width: int | None = None) -> Image.Image:
    im = image.convert("RGB").copy()
    d = ImageDraw.Draw(im)
    w = width or max(2, round(min(im.size) / 150))
    for i, b in enumerate(boxes):
        color = COLORS[i % len(COLORS)]
        d.rectangle(b["box"], outline=color, width=w)
        label = b.get("label") or str(i + 1)
        x, y = b["box"][0], max(0, b["box"][1] - 12)
        tb = d.textbbox((x, y), label)
        d.rectangle(tb, fill=color)
        d.text((x, y), label, fill="white")
    return im
