"""Youtu-VL at run time: the vision graph driven per image (window layout, 2-D RoPE tables, the
merger rows back in the processor's order) and the answer's grounding coordinates rewritten to
the original images' pixels."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ...blocks.base import config_args
from ...boxes import Box
from ...errors import EdgevlError
from ...runtime import Net
from ..protocol import OutputProcessor
from . import processing
from .config import WINDOW_SLOTS, VisionArgs


@dataclass
class WindowLayout:
    """Where each processor-order patch sits in the packed window layout, and the slots."""
    position: np.ndarray     # [N] row in the packed layout of processor-order patch n
    slots: list              # per used slot: (windows n, rows per window s, first row)

    @property
    def rows(self) -> int:
        return len(self.position)


def window_layout(gh: int, gw: int, v: VisionArgs) -> WindowLayout:
    """Windows in processor window order, regrouped by size (largest first) into slots."""
    window_index, cu = processing.window_partition(gh, gw, v.window_size, v.patch_size, v.spatial_merge_size)
    sizes = np.diff(cu)
    classes = sorted(set(sizes.tolist()), reverse=True)
    if len(classes) > WINDOW_SLOTS:  # a raster tiling has at most 4
        raise EdgevlError(f"{len(classes)} window sizes in one image; at most {WINDOW_SLOTS} are supported")
    order = np.concatenate([np.flatnonzero(sizes == c) for c in classes])     # windows, packed order
    m2 = v.spatial_merge_size ** 2
    win_order = (window_index[:, None] * m2 + np.arange(m2)).ravel()        # processor ids in window order
    packed_start = np.empty(len(sizes), np.int64)
    packed_start[order] = np.concatenate([[0], np.cumsum(sizes[order])[:-1]])
    window_of = np.repeat(np.arange(len(sizes)), sizes)
    offset_in = np.arange(gh * gw) - np.repeat(cu[:-1], sizes)
    position = np.empty(gh * gw, np.int64)
    position[win_order] = packed_start[window_of] + offset_in
    slots, start = [], 0
    for c in classes:
        n = int((sizes == c).sum())
        slots.append((n, int(c), start))
        start += n * int(c)
    return WindowLayout(position, slots)


class VisionEncoder:
    """Runs the vision graph for one image: preprocessing, window layout, RoPE tables, row order."""

    def __init__(self, net: Net, info: dict):
        self.net, self.info = net, info
        shapes = info["inputs"].get("window_shapes")
        if not (isinstance(shapes, list) and len(shapes) == WINDOW_SLOTS):
            raise EdgevlError("the package's vision graph uses an older window layout; convert the model again")
        # checked like a config: a damaged manifest must fail in one line, not divide by zero
        self.v = config_args(VisionArgs, info["extra"]["vision_args"], where="manifest.json vision_args")
        n = info["extra"].get("max_image_patches")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise EdgevlError(f"manifest.json graphs.vision.extra.max_image_patches must be a positive integer, "
                              f"got {n!r:.40}; convert the model again")
        self.default_max_patches = n

    def preprocess(self, image, max_image_patches=None) -> dict:
        n = self.default_max_patches if max_image_patches is None else int(max_image_patches)
        pre = processing.preprocess(image, n, patch_size=self.v.patch_size, merge_size=self.v.spatial_merge_size)
        pre["max_image_patches"] = n
        return pre

    def image_tokens(self, height: int, width: int, max_image_patches=None) -> int:
        """Tokens an image of this size will take, from its size alone (nothing decoded)."""
        n = self.default_max_patches if max_image_patches is None else max_image_patches
        m = self.v.spatial_merge_size
        th, tw = processing.target_size(height, width, n, self.v.patch_size, m)
        return (th // self.v.patch_size) * (tw // self.v.patch_size) // (m * m)

    def inputs(self, pre: dict) -> tuple[dict, WindowLayout]:
        v = self.v
        gh, gw = pre["spatial_shapes"]
        lay = window_layout(gh, gw, v)
        N = lay.rows
        pv = np.empty((N, v.patch_dim), np.float32)
        pv[lay.position] = pre["pixel_values"]
        ang = np.empty((N, v.head_dim // 2), np.float32)
        ang[lay.position] = processing.vision_rope_angles(gh, gw, v.head_dim, v.rope_theta, v.spatial_merge_size)
        names = self.info["inputs"]
        feeds = {names["pixel_values"]: pv, names["cos"]: np.cos(ang), names["sin"]: np.sin(ang)}
        # only the shapes of these inputs are read (unused slots: the last row as a 1-row window)
        slots = lay.slots + [(1, 1, N - 1)] * (WINDOW_SLOTS - len(lay.slots))
        for (n, size, start), shape, first in zip(slots, names["window_shapes"], names["window_starts"]):
            feeds[shape] = np.zeros((n, size), np.float32)
            feeds[first] = np.zeros(start + 1, np.float32)
        return feeds, lay

    def __call__(self, image, max_image_patches=None, extract_layers: bool = False):
        """Merger rows [N/4, hidden] in processor order, and the processor info (plus layers)."""
        pre = self.preprocess(image, max_image_patches)
        feeds, lay = self.inputs(pre)
        outs = self.info["outputs"]
        names = (outs["layers"] + [outs["post_ln"]] if extract_layers else []) + [outs["merged"]]
        res = self.net.run(feeds, names)
        m2 = self.v.spatial_merge_size ** 2
        group_pos = lay.position[::m2] // m2
        rows = res[-1][group_pos]
        info = {k: pre[k] for k in ("spatial_shapes", "image_size", "resized_size", "num_image_tokens",
                                    "max_image_patches")}
        info["grid"] = tuple(int(x) // self.v.spatial_merge_size for x in pre["spatial_shapes"])
        if extract_layers:
            info["layers"] = [r[lay.position] for r in res[:-1]]
            info["pixel_values"] = pre["pixel_values"]
        return rows, info


# ---------------------------------------------------------------------------------------------
# output: grounding coordinates (docs/models/youtu_vl.md, "Grounding")
#
# The model writes coordinates as tokens ``<x_i>``/``<y_i>`` in pixels of the *resized* image;
# the reference ``generate(..., img_input=...)`` rescales them to the original image. We rewrite
# them in the streamed text instead of mapping token ids: the numbers are pixels of the original
# image, clamped to that image (not to the 2048 coordinate tokens, nor to a small vocabulary's).
#
# Which image a coordinate refers to: the reference passes one image, the last one of the
# conversation (ADP demo ``process_input``), so by default every coordinate is in the prompt's
# last image. With several images the answer can say which it means: the last mention before a
# coordinate of "image 2" / "picture 2" / "photo #2" / "the second image" (1-based, prompt order)
# assigns it to that image; mentions of images the prompt does not have are ignored.

COORD_RE = re.compile(r"<([xy])_(\d+)>")
PARTIAL_COORD_RE = re.compile(r"<(?:[xy](?:_\d*)?)?$")           # text that may grow into one
BOX_RE = re.compile(r"<box>\s*<x_(\d+)>\s*<y_(\d+)>\s*<x_(\d+)>\s*<y_(\d+)>\s*</box>")
LABEL_RE = re.compile(r"<(ref|label)>(.*?)</\1>", re.S)          # as the ADP demo's vis.py
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth")
MENTION_RE = re.compile(r"\b(?:image|picture|photo|img)\s*#?\s*(\d+)\b|\b(" + "|".join(ORDINALS) +
                        r")\s+(?:image|picture|photo)\b", re.I)
MENTION_LOOKBACK = 32  # characters re-scanned for a mention split across streamed pieces


class GroundingProcessor(OutputProcessor):
    """Rescales ``<x_i>``/``<y_i>`` in the answer to original-image pixels and collects
    ``<box>`` answers (label: the last ``<ref>``/``<label>`` before the box) as Box tuples."""

    def __init__(self, images: list[dict]):
        # (original (h, w), resized (h, w)) per image
        self.sizes = [(tuple(i["image_size"]), tuple(i["resized_size"])) for i in images]
        self.text = ""          # rewritten text returned so far
        self.pending = ""       # held back: may be the start of a coordinate token
        self.mentions: list[tuple[int, int]] = []   # (end offset in text, image index)
        self._mention_scan = 0
        self._found: list[tuple[int, Box]] = []      # (end offset, box)
        self._box_scan = 0

    def image_at(self, offset: int) -> int:
        """The image a coordinate at ``offset`` of the text refers to (module comment)."""
        for end, k in reversed(self.mentions):
            if end <= offset:
                return k
        return len(self.sizes) - 1

    def _scan_mentions(self, upto: int) -> None:
        if len(self.sizes) < 2:
            return
        start = max(self._mention_scan, upto - MENTION_LOOKBACK, 0)
        for m in MENTION_RE.finditer(self.text, start, upto):
            k = int(m.group(1)) - 1 if m.group(1) else ORDINALS.index(m.group(2).lower())
            if 0 <= k < len(self.sizes) and (not self.mentions or self.mentions[-1][0] < m.end()):
                self.mentions.append((m.end(), k))
        self._mention_scan = max(self._mention_scan, upto - MENTION_LOOKBACK)

    def rescale(self, axis: str, value: int, image: int) -> int:
        (oh, ow), (rh, rw) = self.sizes[image]
        orig, resized = (ow, rw) if axis == "x" else (oh, rh)
        return min(max(round(value * orig / resized), 0), orig - 1)  # round half to even, as torch

    def feed(self, text: str) -> str:
        s = self.pending + text
        m = PARTIAL_COORD_RE.search(s)
        cut = m.start() if m else len(s)
        s, self.pending = s[:cut], s[cut:]
        return self._release(s)

    def flush(self) -> str:
        s, self.pending = self.pending, ""
        return self._release(s)

    def _append(self, s: str) -> None:
        self.text += s
        self._scan_mentions(len(self.text))

    def _release(self, s: str) -> str:
        base, last = len(self.text), 0
        for m in COORD_RE.finditer(s):
            self._append(s[last:m.start()])
            axis, k = m.group(1), self.image_at(len(self.text))
            self._append(f"<{axis}_{self.rescale(axis, int(m.group(2)), k)}>")
            last = m.end()
        self._append(s[last:])
        for b in BOX_RE.finditer(self.text, self._box_scan):
            labels = [lm.group(2).strip() for lm in LABEL_RE.finditer(self.text, 0, b.start())]
            x1, y1, x2, y2 = (int(v) for v in b.groups())
            self._found.append((b.end(), Box.of(labels[-1] if labels else None, x1, y1, x2, y2,
                                                self.image_at(b.start()))))
            self._box_scan = b.end()
        return self.text[base:]

    def boxes(self, shown: int | None = None) -> list:
        return [b for end, b in self._found if shown is None or end <= shown]


def parse_boxes(text: str, n_images: int = 1) -> list:
    """The boxes of an answer whose coordinates are already pixels (the images' sizes unknown):
    labels and image assignment as ``GroundingProcessor``, coordinates as written."""
    class _Identity(GroundingProcessor):
        def rescale(self, axis, value, image):
            return value

    p = _Identity([{"image_size": (1, 1), "resized_size": (1, 1)}] * max(1, n_images))
    p.feed(text)
    p.flush()
    return p.boxes()
