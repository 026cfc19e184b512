"""Seeded synthetic scenes for the offline demo model: coloured shapes (and sometimes a word).

A scene is a 128x128 RGB image with a plain background and 1-3 non-overlapping shapes, each a
(colour, shape, size) triple with a position; about a third of the scenes also show a short
word or number drawn with Pillow's built-in bitmap font (so nothing needs to be downloaded).
``Scene.qa()`` gives question/answer pairs in a small, regular grammar that a tiny model can
learn; ``parse_description`` / ``parse_count`` read answers back for evaluation.

Layout: objects are placed on the vision tower's 16-px patch grid (top-left corners at
4 + 16k px, jittered by +-2 px) in two fixed sizes (24 and 40 px). A from-scratch ViT with 16-px
patches and no convolutions has to learn every sub-patch alignment of a shape separately; with
arbitrary positions and sizes shape recognition needed many times more training than the demo's
CPU budget, while grid-aligned shapes are learned within minutes. Colours are jittered.

Boxes follow Youtu-VL's grounding convention (docs/models/youtu_vl.md, section 11):
``<box><x_{x1}><y_{y1}><x_{x2}><y_{y2}></box>`` in resized-image pixels. The demo processor
keeps 128x128 images at their size, so these are plain image pixels; x2/y2 are inclusive
(the last pixel row/column of the shape), so every coordinate is in 0..127.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field
from functools import lru_cache

from PIL import Image, ImageDraw, ImageFont

IMAGE_SIZE = 128

# Clearly distinct, saturated colours; none is close to a background.
COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 230),
    "yellow": (245, 210, 20),
    "purple": (140, 50, 190),
    "orange": (250, 130, 10),
}
BACKGROUNDS = {
    "white": (255, 255, 255),
    "light grey": (195, 195, 195),
    "black": (0, 0, 0),
}
SHAPES = ("circle", "square", "triangle", "star")
SIZES = {"small": 24, "large": 40}  # side of the square the shape is drawn in, px
WORDS = ("CAT", "DOG", "SUN", "HI", "OK", "YES", "NO", "BOX", "1", "2", "3", "7", "10", "42", "99", "100")
NUMBER_WORDS = {1: "One", 2: "Two", 3: "Three", 4: "Four", 5: "Five"}

TEXT_PROBABILITY = 0.35
TEXT_SCALE = 2          # the bitmap font is ~6x11 px per glyph; drawn 2x for legibility
GAP = 4                 # minimum free pixels between two objects
MARGIN = 2              # minimum distance of an object from the image border
GRID, GRID_OFFSET, POSITION_JITTER = 16, 4, 2  # objects sit at 4 + 16k (+-2) px, see below
COLOUR_JITTER = 10      # +- per channel, so the model does not rely on exact RGB values
BACKGROUND_JITTER = 6

_THIRD = IMAGE_SIZE / 3
_POSITION_WORDS = {
    ("top", "left"): "at the top left",
    ("top", "center"): "at the top",
    ("top", "right"): "at the top right",
    ("middle", "left"): "on the left",
    ("middle", "center"): "in the center",
    ("middle", "right"): "on the right",
    ("bottom", "left"): "at the bottom left",
    ("bottom", "center"): "at the bottom",
    ("bottom", "right"): "at the bottom right",
}

# Question kinds, in the order qa() lists them.
DESCRIBE_Q = "Describe the image."
COUNT_Q = "How many shapes are there?"
BACKGROUND_Q = "What color is the background?"
TEXT_Q = "What is written?"


@dataclass
class Shape:
    shape: str            # one of SHAPES
    colour: str           # one of COLOURS
    size: str             # "small" | "large"
    bbox: tuple           # (x1, y1, x2, y2) of the drawn pixels, inclusive
    frame: tuple          # (x0, y0, side): the square the shape was drawn in

    @property
    def center(self) -> tuple[float, float]:
        x1, y1, x2, y2 = self.bbox
        return (x1 + x2) / 2, (y1 + y2) / 2

    @property
    def position(self) -> str:
        return position_words(*self.center)

    def phrase(self) -> str:
        return f"{self.size} {self.colour} {self.shape} {self.position}"


@dataclass
class Scene:
    background: str
    shapes: list                          # list[Shape], ordered left to right (by centre x)
    text: str | None = None
    text_bbox: tuple | None = None        # (x1, y1, x2, y2) inclusive, of the text's pixels
    image: Image.Image | None = field(default=None, repr=False)

    @property
    def count(self) -> int:
        return len(self.shapes)

    def truth_pairs(self) -> set:
        return {(s.colour, s.shape) for s in self.shapes}

    # -- answers -------------------------------------------------------------------------------
    def description(self) -> str:
        parts = [s.phrase() for s in self.shapes]
        if len(parts) == 1:
            body = f"a {parts[0]}"
        else:
            body = ", ".join(f"a {p}" for p in parts[:-1]) + f" and a {parts[-1]}"
        # Text in the image is left to "What is written?": reading it is much harder for the tiny
        # model than the shapes, and a description should not fail on it.
        return body[0].upper() + body[1:] + "."

    def qa_items(self) -> list[tuple[str, str, str]]:
        """(kind, question, answer) for every question this scene answers unambiguously."""
        items = [
            ("describe", DESCRIBE_Q, self.description()),
            ("count", COUNT_Q, NUMBER_WORDS[self.count] + "."),
            ("background", BACKGROUND_Q, self.background.capitalize() + "."),
        ]
        by_shape: dict[str, list[Shape]] = {}
        by_colour: dict[str, list[Shape]] = {}
        for s in self.shapes:
            by_shape.setdefault(s.shape, []).append(s)
            by_colour.setdefault(s.colour, []).append(s)
        for name in SHAPES:
            if len(by_shape.get(name, ())) == 1:
                s = by_shape[name][0]
                items.append(("colour", f"What color is the {name}?", s.colour.capitalize() + "."))
        for name in COLOURS:
            if len(by_colour.get(name, ())) == 1:
                s = by_colour[name][0]
                items.append(("shape", f"What is the {name} shape?", f"A {s.size} {s.shape}."))
        for name in SHAPES:
            if len(by_shape.get(name, ())) == 1:
                items.append(("where", f"Where is the {name}?", box_answer(by_shape[name][0].bbox)))
        items.append(("text", TEXT_Q, f"{self.text}." if self.text is not None else "Nothing."))
        return items

    def qa(self) -> list[tuple[str, str]]:
        """(question, answer) pairs in plain English; boxes use coordinate tokens."""
        return [(q, a) for _, q, a in self.qa_items()]


# ---------------------------------------------------------------------------------------------
# Grammar helpers
# ---------------------------------------------------------------------------------------------


def _center(bbox) -> tuple[float, float]:
    x1, y1, x2, y2 = bbox
    return (x1 + x2) / 2, (y1 + y2) / 2


def position_words(cx: float, cy: float) -> str:
    """A 3x3-grid position phrase for a point in the 128x128 image."""
    col = "left" if cx < _THIRD else "right" if cx >= 2 * _THIRD else "center"
    row = "top" if cy < _THIRD else "bottom" if cy >= 2 * _THIRD else "middle"
    return _POSITION_WORDS[(row, col)]


def box_answer(bbox) -> str:
    x1, y1, x2, y2 = (int(v) for v in bbox)
    return f"<box><x_{x1}><y_{y1}><x_{x2}><y_{y2}></box>"


_BOX_RE = re.compile(r"<box><x_(\d+)><y_(\d+)><x_(\d+)><y_(\d+)></box>")
_PAIR_RE = re.compile(r"\b(" + "|".join(COLOURS) + r")\s+(" + "|".join(SHAPES) + r")s?\b", re.I)
_COUNT_RE = re.compile(r"\b(" + "|".join(w.lower() for w in NUMBER_WORDS.values()) + r"|\d+)\b", re.I)


def parse_box(text: str) -> tuple | None:
    """(x1, y1, x2, y2) of the first ``<box>`` answer in ``text``, or None."""
    m = _BOX_RE.search(text)
    return tuple(int(g) for g in m.groups()) if m else None


def parse_description(text: str) -> set:
    """The set of (colour, shape) pairs a description names ("a small red circle" -> ("red", "circle")).

    Only the first sentence is read, so nothing after it (say, a quoted word) counts as a shape.
    """
    body = re.split(r"[.!?](\s|$)", text, maxsplit=1)[0]
    return {(c.lower(), s.lower()) for c, s in _PAIR_RE.findall(body)}


def parse_count(text: str) -> int | None:
    """The number a counting answer gives ("Two." -> 2), or None when it names none."""
    m = _COUNT_RE.search(text)
    if not m:
        return None
    w = m.group(1).lower()
    if w.isdigit():
        return int(w)
    return {v.lower(): k for k, v in NUMBER_WORDS.items()}[w]


# ---------------------------------------------------------------------------------------------
# Drawing
# ---------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _font():
    # The bitmap font is identical on every Pillow build (load_default() returns a FreeType font
    # on Pillow >= 10.1 when FreeType is available, whose rendering can vary between builds).
    loader = getattr(ImageFont, "load_default_imagefont", None)
    return loader() if loader else ImageFont.load_default()


def _text_mask(text: str) -> Image.Image:
    """The text drawn white on black, scaled TEXT_SCALE x with nearest neighbour, cropped tight."""
    font = _font()
    left, top, right, bottom = font.getbbox(text)
    im = Image.new("L", (right - left + 2, bottom - top + 2), 0)
    ImageDraw.Draw(im).text((1 - left, 1 - top), text, fill=255, font=font)
    im = im.crop(im.getbbox())
    return im.resize((im.width * TEXT_SCALE, im.height * TEXT_SCALE), Image.NEAREST)


def _star_points(x0: float, y0: float, side: float) -> list[tuple[float, float]]:
    cx, cy = x0 + side / 2, y0 + side / 2
    # Centre the star's own bounding box in the frame (its points reach 0.81 r below the centre).
    r_out = side / 2
    cy += r_out * (1 - math.cos(math.pi / 5)) / 2
    r_in = r_out * 0.42
    pts = []
    for k in range(10):
        r = r_out if k % 2 == 0 else r_in
        a = -math.pi / 2 + k * math.pi / 5
        pts.append((cx + r * math.cos(a), cy + r * math.sin(a)))
    return pts


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, x0: int, y0: int, side: int, fill) -> None:
    x1, y1 = x0 + side - 1, y0 + side - 1
    if shape == "circle":
        draw.ellipse((x0, y0, x1, y1), fill=fill)
    elif shape == "square":
        draw.rectangle((x0, y0, x1, y1), fill=fill)
    elif shape == "triangle":
        draw.polygon([(x0 + (side - 1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)
    elif shape == "star":
        draw.polygon(_star_points(x0, y0, side), fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def _mask(shape: str, x0: int, y0: int, side: int) -> Image.Image:
    """An "L" mask (255 inside) of the pixels ``_draw_shape`` paints."""
    mask = Image.new("L", (IMAGE_SIZE, IMAGE_SIZE), 0)
    _draw_shape(ImageDraw.Draw(mask), shape, x0, y0, side, 255)
    return mask


def shape_mask(s: Shape) -> Image.Image:
    """An "L" mask (255 inside) of the pixels a scene's shape covers."""
    return _mask(s.shape, *s.frame)


def _shape_bbox(shape: str, x0: int, y0: int, side: int) -> tuple:
    """Inclusive bbox of the pixels _draw_shape paints (measured on a mask, so it is exact)."""
    left, top, right, bottom = _mask(shape, x0, y0, side).getbbox()
    return (left, top, right - 1, bottom - 1)


def _jitter(rgb, rng: random.Random, amount: int) -> tuple:
    return tuple(min(255, max(0, c + rng.randint(-amount, amount))) for c in rgb)


def _overlaps(a, b, gap: int = GAP) -> bool:
    """Inclusive boxes a and b closer than ``gap`` free pixels."""
    return not (a[2] + gap < b[0] or b[2] + gap < a[0] or a[3] + gap < b[1] or b[3] + gap < a[1])


def _grid_position(rng: random.Random, extent: int) -> int:
    """A grid-aligned, jittered start coordinate keeping ``extent`` px inside the margins."""
    last = (IMAGE_SIZE - MARGIN - extent - POSITION_JITTER - GRID_OFFSET) // GRID
    v = GRID_OFFSET + GRID * rng.randint(0, last) + rng.randint(-POSITION_JITTER, POSITION_JITTER)
    return min(max(v, MARGIN), IMAGE_SIZE - MARGIN - extent)


def _as_rng(rng_or_seed) -> random.Random:
    if isinstance(rng_or_seed, random.Random):
        return rng_or_seed
    return random.Random(rng_or_seed)


def make_scene(rng_or_seed=None, n_shapes: int | None = None, share: float = 0.0) -> Scene:
    """One random scene; ``rng_or_seed`` is a ``random.Random`` (advanced in place) or a seed.

    ``n_shapes`` fixes the number of shapes (1-3); by default it is drawn uniformly. ``share`` is
    the probability that a second or third shape takes the colour or the kind of one already
    placed (harder scenes for training; 0 leaves the seeded streams unchanged).
    """
    rng = _as_rng(rng_or_seed)
    if n_shapes is not None and not 1 <= n_shapes <= 3:
        raise ValueError(f"n_shapes must be 1, 2 or 3, got {n_shapes}")
    while True:  # rejection sampling; a layout that does not fit is redrawn from scratch
        scene = _try_scene(rng, n_shapes, share)
        if scene is not None:
            return scene


def make_scenes(seed, n: int) -> list[Scene]:
    """``n`` scenes from one seeded stream (``make_scenes(s, n)[:k] == make_scenes(s, k)``)."""
    rng = random.Random(seed)
    return [make_scene(rng) for _ in range(n)]


def _try_scene(rng: random.Random, n_shapes: int | None = None, share: float = 0.0) -> Scene | None:
    background = rng.choice(list(BACKGROUNDS))
    n = rng.randint(1, 3) if n_shapes is None else n_shapes
    text = rng.choice(WORDS) if rng.random() < TEXT_PROBABILITY else None
    boxes = []
    text_bbox = None
    text_mask = None
    if text is not None:
        text_mask = _text_mask(text)
        w, h = text_mask.size
        tx, ty = _grid_position(rng, w), _grid_position(rng, h)
        text_bbox = (tx, ty, tx + w - 1, ty + h - 1)
        boxes.append(text_bbox)
    used = set()
    specs = []
    for _ in range(n):
        for _attempt in range(50):
            shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
            if share and specs and rng.random() < share:
                other = rng.choice(specs)
                colour, shape = (other.colour, shape) if rng.random() < 0.5 else (colour, other.shape)
            if (colour, shape) in used:
                continue
            size = rng.choice(list(SIZES))
            side = SIZES[size]
            x0, y0 = _grid_position(rng, side), _grid_position(rng, side)
            bbox = _shape_bbox(shape, x0, y0, side)
            if any(_overlaps(bbox, b) for b in boxes):
                continue
            used.add((colour, shape))
            boxes.append(bbox)
            specs.append(Shape(shape, colour, size, bbox, (x0, y0, side)))
            break
        else:
            return None
    specs.sort(key=lambda s: (s.center[0], s.center[1]))

    bg = _jitter(BACKGROUNDS[background], rng, BACKGROUND_JITTER)
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), bg)
    draw = ImageDraw.Draw(image)
    for s in specs:
        x0, y0, side = s.frame
        _draw_shape(draw, s.shape, x0, y0, side, _jitter(COLOURS[s.colour], rng, COLOUR_JITTER))
    if text is not None:
        ink = (255, 255, 255) if background == "black" else (0, 0, 0)
        image.paste(Image.new("RGB", text_mask.size, ink), text_bbox[:2], text_mask)
    return Scene(background=background, shapes=specs, text=text, text_bbox=text_bbox, image=image)
