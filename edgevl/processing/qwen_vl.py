"""The Qwen2-VL image processor (used by Qwen2.5-VL, Qwen3-VL and Qwen3.5) in numpy + Pillow.

Reproduces transformers' default ``Qwen2VLImageProcessor`` (its torchvision backend, the class
real checkpoints name as ``Qwen2VLImageProcessorFast``; docs/models/qwen3_5.md, section 8) bit
for bit, driven by the checkpoint's ``preprocessor_config.json``:

1. decode to 8-bit RGB (``image.load_image``: EXIF orientation for paths);
2. ``smart_resize``: both sides to multiples of patch x merge, pixel count within
   [shortest_edge, longest_edge] (older files: min_pixels / max_pixels), aspect kept;
3. resize of the uint8 image as torchvision does it (``image.resize_torchvision``: torch's uint8
   antialiased bicubic unless the file says otherwise);
4. rescale and normalize fused as that class does, in float32:
   (x - mean / rescale_factor) / (std / rescale_factor) (:func:`rescale_normalize`);
5. patchify: one row per 16x16 patch in (C, T=2, 16, 16) order (the frame repeated for the
   temporal patch), patches grouped by 2x2 merge blocks, blocks in raster order.

transformers' PIL backend (``Qwen2VLImageProcessorPil``) resizes with Pillow instead and
rescales before normalizing; its pixels differ by a level or two and its values in the last bits.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from ..errors import EdgevlError
from .image import load_image, resize_torchvision

# transformers' Qwen2VLImageProcessor class defaults (used where the file is silent)
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280
OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
MAX_ASPECT = 200


@dataclass
class ProcessorConfig:
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    image_mean: list = field(default_factory=lambda: list(OPENAI_CLIP_MEAN))
    image_std: list = field(default_factory=lambda: list(OPENAI_CLIP_STD))
    rescale_factor: float = 1 / 255
    resample: int = Image.BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    @classmethod
    def from_dict(cls, d: dict) -> ProcessorConfig:
        c = read_fields(cls(), d, ("patch_size", "temporal_patch_size", "merge_size", "rescale_factor", "resample",
                                   "do_resize", "do_rescale", "do_normalize"))
        if c.min_pixels > c.max_pixels:
            raise EdgevlError(f"preprocessor_config.json: the minimum pixel count {c.min_pixels} exceeds the "
                              f"maximum {c.max_pixels}; fix the file")
        return c

    @classmethod
    def from_folder(cls, folder) -> ProcessorConfig:
        p = Path(folder) / "preprocessor_config.json"
        if not p.is_file():
            return cls()
        try:
            return cls.from_dict(json.loads(p.read_text()))
        except json.JSONDecodeError as e:
            raise EdgevlError(f"{p} is not valid JSON ({e.msg} at line {e.lineno}); fix or re-download it") from None

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size


def read_fields(c, d: dict, keys, typed: bool = False):
    """``c`` (a processor config) with the file ``d``'s values: ``keys`` as given (``typed``: cast
    to the default's type), the mean and std (a number means all three channels), and the pixel
    budget (transformers: min_pixels / max_pixels override size.shortest_edge / longest_edge)."""
    for k in keys:
        if d.get(k) is not None:
            setattr(c, k, type(getattr(c, k))(d[k]) if typed else d[k])
    for k in ("image_mean", "image_std"):
        v = d.get(k)
        if v is not None:
            setattr(c, k, list(v) if isinstance(v, (list, tuple)) else [v] * 3)
    size = d.get("size") or {}
    c.min_pixels = int(d.get("min_pixels") or size.get("shortest_edge") or c.min_pixels)
    c.max_pixels = int(d.get("max_pixels") or size.get("longest_edge") or c.max_pixels)
    return c


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' ``smart_resize``: round each side to the factor (Python round, halves to
    even), then scale down (floor) above max_pixels or up (ceil) below min_pixels."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise EdgevlError(f"the image is {width}x{height}: its aspect ratio exceeds {MAX_ASPECT}:1, which this "
                          "model's processor refuses; crop or pad it first")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def rescale_normalize(x: np.ndarray, cfg) -> np.ndarray:
    """uint8 pixels [..., C, H, W] -> float32 as transformers' torchvision processors compute them.

    With both steps on they are one: mean and std are first multiplied by 1 / rescale_factor in
    float32, then (x - mean) / std in float32, so the values equal transformers' bit for bit.
    Alone, rescale is x * rescale_factor and normalize (x - mean) / std, both in float32.
    """
    x = x.astype(np.float32)
    mean = np.asarray(cfg.image_mean, np.float32)[:, None, None]
    std = np.asarray(cfg.image_std, np.float32)[:, None, None]
    if cfg.do_rescale and cfg.do_normalize:
        inv = np.float32(1.0 / cfg.rescale_factor)  # a Python float, used by torch as float32
        return (x - mean * inv) / (std * inv)
    if cfg.do_normalize:
        return (x - mean) / std
    if cfg.do_rescale:
        return x * np.float32(cfg.rescale_factor)
    return x


def patchify(chw: np.ndarray, patch: int, merge: int, temporal: int) -> np.ndarray:
    """(C, H, W) -> [gh*gw, C*T*p*p] rows in merge-block order (the frame repeated T times)."""
    c, h, w = chw.shape
    gh, gw = h // patch, w // patch
    x = chw.reshape(c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.transpose(1, 4, 2, 5, 0, 3, 6)                        # (gh/m, gw/m, m, m, C, p, p)
    x = np.broadcast_to(x[:, :, :, :, :, None], x.shape[:5] + (temporal,) + x.shape[5:])
    return np.ascontiguousarray(x).reshape(gh * gw, c * temporal * patch * patch)


def preprocess(image, cfg: ProcessorConfig) -> dict:
    """pixel_values [N, C*T*p*p] float32 and the grid (1, gh, gw) of one image (path or PIL)."""
    im = load_image(image)
    h, w = im.height, im.width
    th, tw = smart_resize(h, w, cfg.factor, cfg.min_pixels, cfg.max_pixels) if cfg.do_resize else (h, w)
    if th % cfg.factor or tw % cfg.factor:
        raise EdgevlError(f"the image is {w}x{h} but without resizing its sides must be multiples of "
                          f"{cfg.factor}; enable do_resize in preprocessor_config.json")
    x = resize_torchvision(im, th, tw, cfg.resample).transpose(2, 0, 1)   # uint8 (C, H, W)
    pv = patchify(rescale_normalize(x, cfg), cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size)
    gh, gw = th // cfg.patch_size, tw // cfg.patch_size
    return {"pixel_values": pv, "grid_thw": (1, gh, gw), "image_size": (h, w), "resized_size": (th, tw),
            "num_image_tokens": gh * gw // cfg.merge_size ** 2}
