"""Youtu-VL image preprocessing in numpy + Pillow (no torch).

Reproduces the HF processor (customised ``Siglip2ImageProcessorFast`` driven by
``YoutuVLProcessor``) bit for bit on CPU, plus the index/angle tables the vision tower needs:

* :func:`load_image`: decode to 8-bit RGB (spec §3.1).
* :func:`target_size`: the "fit to max patches" step search (spec §3.2).
* :func:`resize_uint8_antialias`: PyTorch's uint8 antialiased bilinear kernel (spec §3.3).
* :func:`preprocess`: resize, normalise and patchify in 2x2-merge order (spec §3.4, §3.5).
* :func:`window_partition`, :func:`apply_window_order`, :func:`restore_order`: window
  grouping (spec §4.3, §4.6).
* :func:`vision_rope_angles`: the 2-D RoPE angle table (spec §4.4).

Section numbers refer to ``shared/specs/youtu_vl.md``.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from edgevl.errors import EdgevlError

__all__ = [
    "load_image",
    "target_size",
    "resize_uint8_antialias",
    "preprocess",
    "window_partition",
    "apply_window_order",
    "restore_order",
    "vision_rope_angles",
    "DEFAULT_MAX_IMAGE_PATCHES",
    "MAX_IMAGE_PATCHES",
    "PATCH_SIZE",
    "MERGE_SIZE",
]

# §2.3: the processor call overrides preprocessor_config's 256 with 36864.
DEFAULT_MAX_IMAGE_PATCHES = 36864
# The largest budget accepted (a 4096x4096 image at 16 px patches). Tested to run on this ncnn
# wheel; far larger budgets crashed ncnn (a segfault, not an error) and would take hours anyway.
MAX_IMAGE_PATCHES = 65536
PATCH_SIZE = 16
MERGE_SIZE = 2

# Temporary int32 accumulators in the resize are kept to about this many elements
# (4 bytes each), so memory stays flat whatever the image size.
_BLOCK_ELEMS = 1 << 21

_16BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")


# --------------------------------------------------------------------------------------------
# §3.1 Decode
# --------------------------------------------------------------------------------------------


def load_image(image) -> Image.Image:
    """Return ``image`` (a path or a PIL image) as a loaded 8-bit RGB PIL image.

    Conversion follows ``PIL.Image.convert("RGB")``, which is what HF does: alpha is dropped
    (not composited), palette/CMYK/greyscale/1-bit are expanded. One deliberate exception:
    16-bit greyscale ("I;16*" and "I", which is how Pillow opens 16-bit PNG/TIFF) is scaled
    with ``>> 8``; Pillow would clamp every sample above 255 to white.

    For paths the EXIF orientation is applied first, as ``transformers.image_utils.load_image``
    does; a PIL image passed in is used as it is, like the HF processor does.
    """
    if isinstance(image, Image.Image):
        try:
            image.load()  # a lazily opened image may still be truncated
        except Exception as e:  # noqa: BLE001 - PIL raises many types for bad data
            raise EdgevlError(
                f"Could not decode the image ({type(e).__name__}: {e}); re-save it as PNG or JPEG."
            ) from None
        return _to_rgb(image, "the image")
    if isinstance(image, (str, os.PathLike)):
        return _open_path(Path(image))
    raise EdgevlError(
        f"Unsupported image type {type(image).__name__}; pass a file path or a PIL.Image.Image."
    )


def _open_path(path: Path) -> Image.Image:
    if not path.exists():
        raise EdgevlError(f"Image file not found: {path}; check the path.")
    if path.is_dir():
        raise EdgevlError(f"Image path is a directory, not a file: {path}; pass an image file.")
    try:
        size = path.stat().st_size
    except OSError as e:
        raise EdgevlError(f"Cannot read image file {path} ({e.strerror}); check its permissions.") from None
    if size == 0:
        raise EdgevlError(f"Image file is empty (0 bytes): {path}; re-export or re-download it.")
    try:
        with warnings.catch_warnings():
            # Images between Pillow's warning and error limits are fine for us: they are
            # downscaled by the patch budget (§3.2) and the resize works in row blocks.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            # Pillow does not close a file object it was given, and closing ours leaves the
            # decoded pixels alone: no copy of a huge image (Image.close() would free them).
            with open(path, "rb") as f:
                im = Image.open(f)
                im.load()  # decode now so truncated files fail here, not later
            return _to_rgb(exif_transpose(im), str(path))
    except EdgevlError:
        raise
    except Image.DecompressionBombError as e:
        raise EdgevlError(_bomb_message(path, e)) from None
    except UnidentifiedImageError:
        raise EdgevlError(
            f"Not a readable image file: {path}; use PNG, JPEG, WebP, BMP, GIF or TIFF."
        ) from None
    except PermissionError:
        raise EdgevlError(f"Permission denied reading image file {path}; check its permissions.") from None
    except MemoryError:
        raise EdgevlError(f"Not enough memory to decode {path}; downscale the image first.") from None
    except Exception as e:  # noqa: BLE001 - truncated/corrupt data raises OSError, SyntaxError, ...
        raise EdgevlError(
            f"Could not decode image file {path} (truncated or corrupt: {e}); re-export or re-download it."
        ) from None


def exif_transpose(im: Image.Image) -> Image.Image:
    """EXIF orientation applied as transformers' load_image does, in place where possible (no
    second copy of a big image); a broken EXIF block leaves the image as it is."""
    try:
        ImageOps.exif_transpose(im, in_place=True)
    except Exception:  # noqa: BLE001 - a broken EXIF block must not stop decoding
        pass
    return im


def _bomb_message(path: Path, err: Exception) -> str:
    nums = [int(n) for n in re.findall(r"\d+", str(err))]
    limit = 2 * Image.MAX_IMAGE_PIXELS if Image.MAX_IMAGE_PIXELS else None
    pixels = nums[0] if nums else None
    what = f"{pixels} pixels" if pixels is not None else "too many pixels"
    lim = f" (limit {limit} pixels)" if limit else ""
    return f"Image {path} is too large: {what}{lim}; downscale it before use."


def _to_rgb(im: Image.Image, name: str) -> Image.Image:
    if im.width <= 0 or im.height <= 0:
        raise EdgevlError(f"Image {name} has zero size ({im.width}x{im.height}); pass a non-empty image.")
    try:
        if im.mode == "RGB":
            return im
        if im.mode in _16BIT_MODES or im.mode == "I":
            a = np.asarray(im)
            if im.mode == "I":
                # Mode "I" is int32; Pillow uses it for 16-bit sources, so treat it as 16-bit.
                a = np.clip(a, 0, 65535)
            grey = (a.astype(np.uint32) >> 8).astype(np.uint8)
            return Image.fromarray(grey, mode="L").convert("RGB")
        with warnings.catch_warnings():
            # "Palette images with transparency ... should be converted to RGBA": we drop alpha
            # on purpose (HF converts straight to RGB), so the hint is noise.
            warnings.simplefilter("ignore", UserWarning)
            return im.convert("RGB")
    except Exception as e:  # noqa: BLE001 - e.g. unsupported mode conversion
        raise EdgevlError(
            f"Cannot convert image {name} from mode {im.mode!r} to RGB ({e}); re-save it as RGB PNG or JPEG."
        ) from None


# --------------------------------------------------------------------------------------------
# §3.2 Target size
# --------------------------------------------------------------------------------------------


def target_size(
    height: int,
    width: int,
    max_image_patches: int = DEFAULT_MAX_IMAGE_PATCHES,
    patch_size: int = PATCH_SIZE,
    merge_size: int = MERGE_SIZE,
) -> tuple[int, int]:
    """Resized (height, width): both multiples of patch*merge, rounded up, shrunk in 0.02 steps
    of ``scale`` until the patch count fits ``max_image_patches`` (spec §3.2).

    The arithmetic is Python float64 on purpose: float32 picks a different size for ~0.5 % of
    inputs (spec §3.2, §12.8).
    """
    for name, v in (("height", height), ("width", width)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise EdgevlError(f"Image {name} must be a positive integer, got {v!r}.")
    if patch_size < 1 or merge_size < 1:
        raise EdgevlError(f"patch_size and merge_size must be >= 1, got {patch_size} and {merge_size}.")
    align = patch_size * merge_size
    min_patches = merge_size * merge_size  # the smallest output, align x align
    if isinstance(max_image_patches, bool) or not isinstance(max_image_patches, (int, np.integer)):
        raise EdgevlError(f"max_image_patches must be an integer, got {max_image_patches!r:.40}.")
    if max_image_patches > MAX_IMAGE_PATCHES:
        raise EdgevlError(
            f"max_image_patches={max_image_patches} is above the supported maximum {MAX_IMAGE_PATCHES} "
            f"(a 4096x4096 image); use a smaller budget."
        )
    if max_image_patches < min_patches:
        raise EdgevlError(
            f"max_image_patches={max_image_patches} cannot fit even a {align}x{align} image "
            f"({min_patches} patches); use max_image_patches >= {min_patches}."
        )
    height, width = int(height), int(width)
    scale = 1.0
    while scale > 0:
        th = max(align, math.ceil(height * scale / align) * align)
        tw = max(align, math.ceil(width * scale / align) * align)
        if (th // patch_size) * (tw // patch_size) <= max_image_patches:
            return th, tw
        scale -= 0.02
    # Reached only for tiny budgets with large images (scale 0.02 still too big).
    raise EdgevlError(
        f"A {width}x{height} image cannot be fitted into max_image_patches={max_image_patches}; "
        "raise max_image_patches or downscale the image."
    )


# --------------------------------------------------------------------------------------------
# §3.3 Resize: PyTorch's uint8 antialiased bilinear kernel
# --------------------------------------------------------------------------------------------


def _aa_int16_weights(in_size: int, out_size: int):
    """Tap indices [out, K], int16-valued weights [out, K] and the precision for one axis.

    Mirrors PyTorch's double-precision weight computation for antialiased bilinear
    (align_corners=False, no explicit scale factor) and its int16 quantisation. The order of
    float operations matters for bit-exactness and is kept as in the upstream kernel.
    """
    scale = in_size / out_size
    aa = scale >= 1.0
    support = scale if aa else 1.0  # interp_size/2 * scale for downscale, else 1
    invscale = 1.0 / scale if aa else 1.0  # upstream multiplies by 1/scale, not divides
    ksize = int(math.ceil(support)) * 2 + 1

    center = scale * (np.arange(out_size, dtype=np.float64) + 0.5)
    # astype(int64) truncates toward zero, like the C++ static_cast
    xmin = np.maximum((center - support + 0.5).astype(np.int64), 0)
    xsize = np.minimum((center + support + 0.5).astype(np.int64), in_size) - xmin
    j = np.arange(ksize, dtype=np.int64)
    taps = xmin[:, None] + j[None, :]
    x = (taps.astype(np.float64) - center[:, None] + 0.5) * invscale
    w = np.maximum(1.0 - np.abs(x), 0.0)  # triangle filter
    w[j[None, :] >= xsize[:, None]] = 0.0
    total = np.zeros(out_size, dtype=np.float64)
    for k in range(ksize):  # sequential sum, as upstream (np.sum would pair-wise reorder)
        total += w[:, k]
    nz = total != 0.0
    w[nz] /= total[nz, None]

    # Precision: the largest prec < 22 with round(wmax * 2^(prec+1)) < 2^15 (spec §3.3).
    wmax = float(w.max())
    prec = 0
    while prec < 22 and int(0.5 + wmax * (1 << (prec + 1))) < (1 << 15):
        prec += 1
    wi = (0.5 + w * (1 << prec)).astype(np.int32)  # weights are >= 0, so trunc == round

    kmax = int(xsize.max())  # drop all-zero trailing tap columns: less work, same sums
    taps = np.minimum(taps[:, :kmax], in_size - 1)  # zero-weight taps may point past the edge
    return taps.astype(np.intp), wi[:, :kmax], prec


def _finish(acc: np.ndarray, prec: int) -> np.ndarray:
    np.right_shift(acc, prec, out=acc)
    np.clip(acc, 0, 255, out=acc)
    return acc.astype(np.uint8)


def _horizontal(src: Callable[[int, int], np.ndarray], h: int, w: int, c: int, out_w: int) -> np.ndarray:
    """Resize along width; ``src(r0, r1)`` yields uint8 rows [r1-r0, w, c]."""
    taps, wi, prec = _aa_int16_weights(w, out_w)
    out = np.empty((h, out_w, c), dtype=np.uint8)
    rows = max(1, _BLOCK_ELEMS // max(1, max(w, out_w) * c))
    for r0 in range(0, h, rows):
        r1 = min(h, r0 + rows)
        n = r1 - r0
        # Put width first so each tap gathers whole contiguous rows (fast fancy indexing).
        blk = np.ascontiguousarray(src(r0, r1).transpose(1, 0, 2)).reshape(w, n * c)
        acc = np.full((out_w, n * c), 1 << (prec - 1), dtype=np.int32)  # +0.5 for rounding
        tmp = np.empty_like(acc)
        for k in range(taps.shape[1]):
            np.multiply(blk[taps[:, k]], wi[:, k, None], out=tmp)
            acc += tmp
        out[r0:r1] = _finish(acc, prec).reshape(out_w, n, c).transpose(1, 0, 2)
    return out


def _vertical(img: np.ndarray, out_h: int) -> np.ndarray:
    h, w, c = img.shape
    taps, wi, prec = _aa_int16_weights(h, out_h)
    flat = img.reshape(h, w * c)
    out = np.empty((out_h, w * c), dtype=np.uint8)
    rows = max(1, _BLOCK_ELEMS // max(1, w * c))
    for o0 in range(0, out_h, rows):
        o1 = min(out_h, o0 + rows)
        acc = np.full((o1 - o0, w * c), 1 << (prec - 1), dtype=np.int32)
        tmp = np.empty_like(acc)
        for k in range(taps.shape[1]):
            np.multiply(flat[taps[o0:o1, k]], wi[o0:o1, k, None], out=tmp)
            acc += tmp
        out[o0:o1] = _finish(acc, prec)
    return out.reshape(out_h, w, c)


def _resize_rows(src, h: int, w: int, c: int, out_h: int, out_w: int, full=None) -> np.ndarray:
    # §3.3 step 1: horizontal pass first (if the width changes), stored as uint8, then vertical.
    if out_w != w:
        inter = _horizontal(src, h, w, c, out_w)
    else:
        inter = full() if full is not None else src(0, h)
    if out_h != h:
        return _vertical(np.ascontiguousarray(inter), out_h)
    return np.array(inter, dtype=np.uint8, copy=True) if out_w == w else inter


def resize_uint8_antialias(array_hwc_uint8: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """Bilinear antialiased resize of a uint8 [H, W, C] (or [H, W]) array.

    Bit-exact with ``torch.nn.functional.interpolate(x, size=(out_h, out_w), mode="bilinear",
    antialias=True, align_corners=False)`` on a uint8 tensor on CPU, which is what the HF fast
    processor runs (spec §3.3): separable int16 fixed-point filter, horizontal pass first, a
    uint8 intermediate, then the vertical pass. Works in row blocks with int32 accumulators.
    """
    a = np.asarray(array_hwc_uint8)
    if a.dtype != np.uint8 or a.ndim not in (2, 3):
        raise EdgevlError(
            f"resize_uint8_antialias needs a uint8 [H, W, C] array, got dtype {a.dtype} "
            f"with shape {a.shape}; convert with np.asarray(img, dtype=np.uint8)."
        )
    squeeze = a.ndim == 2
    if squeeze:
        a = a[:, :, None]
    h, w, c = a.shape
    out_h, out_w = int(out_h), int(out_w)
    if min(h, w, c) < 1 or out_h < 1 or out_w < 1:
        raise EdgevlError(
            f"Cannot resize shape {array_hwc_uint8.shape} to {out_h}x{out_w}; all sizes must be >= 1."
        )
    out = _resize_rows(lambda r0, r1: a[r0:r1], h, w, c, out_h, out_w)
    return out[:, :, 0] if squeeze else out


def _resize_pil(im: Image.Image, out_h: int, out_w: int) -> np.ndarray:
    """Same as :func:`resize_uint8_antialias` on ``np.asarray(im)``, reading the RGB PIL image
    in row strips so a huge image never exists twice in memory."""
    w, h = im.size
    return _resize_rows(
        lambda r0, r1: np.asarray(im.crop((0, r0, w, r1))),
        h, w, 3, out_h, out_w,
        full=lambda: np.asarray(im),
    )


# --------------------------------------------------------------------------------------------
# §3.4-3.5 Normalise and patchify
# --------------------------------------------------------------------------------------------

# §3.4: the HF fast path fuses rescale (1/255) and normalise (0.5, 0.5) into mean = std = 127.5
# and computes (u - 127.5) / 127.5 in float32. Each uint8 maps to one value, so a 256-entry
# table reproduces it exactly.
_NORM_LUT = (np.arange(256, dtype=np.float32) - np.float32(127.5)) / np.float32(127.5)


def preprocess(
    image,
    max_image_patches: int = DEFAULT_MAX_IMAGE_PATCHES,
    *,
    patch_size: int = PATCH_SIZE,
    merge_size: int = MERGE_SIZE,
) -> dict:
    """Turn one image (path or PIL image) into the vision tower's input (spec §3).

    Returns a dict with
      * ``pixel_values``: float32 [N, patch*patch*3], patches in merge-group order, channel-last
        inside a patch (spec §3.5); HF's tensor is this with a leading batch axis of 1;
      * ``spatial_shapes``: (gh, gw) in patches, height first; N = gh*gw;
      * ``image_size``: original (H, W); ``resized_size``: (th, tw);
      * ``num_image_tokens``: N / merge^2, the number of <|image_pad|> tokens.
    """
    im = load_image(image)
    h, w = im.height, im.width
    th, tw = target_size(h, w, max_image_patches, patch_size, merge_size)
    resized = _resize_pil(im, th, tw)  # [th, tw, 3] uint8

    p, m = patch_size, merge_size
    gh, gw = th // p, tw // p
    # (R, mh, py, C, mw, px, ch) -> (R, C, mh, mw, py, px, ch): merge groups in raster order,
    # TL/TR/BL/BR inside a group, channel-last inside a patch (spec §3.5). Done on uint8 (cheap),
    # then normalised with the table.
    groups = resized.reshape(gh // m, m, p, gw // m, m, p, 3).transpose(0, 3, 1, 4, 2, 5, 6)
    pixel_values = _NORM_LUT[groups.reshape(gh * gw, p * p * 3)]
    return {
        "pixel_values": pixel_values,
        "spatial_shapes": (gh, gw),
        "image_size": (h, w),
        "resized_size": (th, tw),
        "num_image_tokens": (gh * gw) // (m * m),
    }


# --------------------------------------------------------------------------------------------
# §4.3 Window grouping and §4.4 rotary angles
# --------------------------------------------------------------------------------------------


def _check_grid(gh: int, gw: int, merge_size: int) -> None:
    if gh < merge_size or gw < merge_size or gh % merge_size or gw % merge_size:
        raise EdgevlError(
            f"Patch grid {gh}x{gw} must be positive multiples of merge_size={merge_size}; "
            "use the spatial_shapes returned by preprocess()."
        )


def window_partition(
    gh: int,
    gw: int,
    window_size: int = 256,
    patch_size: int = PATCH_SIZE,
    merge_size: int = MERGE_SIZE,
) -> tuple[np.ndarray, np.ndarray]:
    """(window_index, cu_window_seqlens) for one image, both int64 (spec §4.3).

    The merged grid (gh/merge x gw/merge) is tiled with square windows of
    window_size/merge/patch cells from the top-left, row-major, the last row/column of windows
    possibly partial (same as HF's pad-with--100-and-drop). window_index lists the merge-group
    ids window by window, cells row-major inside each; cu_window_seqlens counts patches.
    """
    _check_grid(gh, gw, merge_size)
    ws = window_size // merge_size // patch_size
    if ws < 1:
        raise EdgevlError(
            f"window_size={window_size} is smaller than one merged cell "
            f"({patch_size * merge_size} px); use a window_size of at least that."
        )
    hm, wm = gh // merge_size, gw // merge_size
    ids = np.arange(hm * wm, dtype=np.int64).reshape(hm, wm)
    parts, lens = [], []
    for r0 in range(0, hm, ws):
        for c0 in range(0, wm, ws):
            cell = ids[r0:r0 + ws, c0:c0 + ws].ravel()
            parts.append(cell)
            lens.append(cell.size * merge_size * merge_size)
    window_index = np.concatenate(parts)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    # HF applies unique_consecutive; with non-empty windows there are no repeats to remove.
    return window_index, cu


def _group_view(x, n_groups: int):
    n = x.shape[0]
    if n_groups < 1 or n % n_groups:
        raise EdgevlError(
            f"Cannot split {n} rows into {n_groups} window groups; "
            "pass rows in processor order with N = merge^2 * len(window_index)."
        )
    return x.reshape(n_groups, n // n_groups, *x.shape[1:])


def apply_window_order(x, window_index):
    """Reorder rows of an [N, ...] array into window order at group granularity:
    ``x_win[g*k + u] = x[g*window_index[k] + u]`` with g = N / len(window_index) (4 for
    merge 2) (spec §4.3). Works for numpy arrays and anything with numpy-style indexing."""
    idx = np.asarray(window_index, dtype=np.int64)
    return _group_view(x, idx.size)[idx].reshape(x.shape)


def restore_order(x_win, window_index):
    """Inverse of :func:`apply_window_order` (spec §4.6): gather with argsort(window_index)."""
    inv = np.argsort(np.asarray(window_index, dtype=np.int64), kind="stable")
    return _group_view(x_win, inv.size)[inv].reshape(x_win.shape)


def vision_rope_angles(
    gh: int,
    gw: int,
    head_dim: int = 72,
    theta: float = 10000.0,
    merge_size: int = MERGE_SIZE,
) -> np.ndarray:
    """float32 [N, head_dim/2] rotary angles in processor (merge-group) order (spec §4.4).

    With q = head_dim/4 frequencies inv[j] = 1 / theta^(2j / (head_dim/2)), a patch at
    patch-grid row r, column c gets [r*inv, c*inv]. The full rotation angle is
    concat(table, table) with rotate_half pairing (i, i + head_dim/2). Computed in float32 like
    the HF VisionRotaryEmbedding. Apply :func:`apply_window_order` to use it in window order.
    """
    _check_grid(gh, gw, merge_size)
    if head_dim < 4 or head_dim % 4:
        raise EdgevlError(f"head_dim={head_dim} must be a positive multiple of 4 for 2-D RoPE.")
    dim = head_dim // 2
    # HF: inv_freq = 1 / theta ** (arange(0, dim, 2, float32) / dim), all float32. The power is
    # taken in float64 and rounded once, i.e. a correctly rounded float32 powf.
    expo = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    inv = np.float32(1.0) / (np.float64(theta) ** expo.astype(np.float64)).astype(np.float32)

    m = merge_size
    r = np.arange(gh).reshape(gh // m, m, 1, 1)
    c = np.arange(gw).reshape(1, 1, gw // m, m)
    # rows/cols per patch in (R, C, mh, mw) order, matching the processor's patch order
    rows = np.broadcast_to(r, (gh // m, m, gw // m, m)).transpose(0, 2, 1, 3).ravel()
    cols = np.broadcast_to(c, (gh // m, m, gw // m, m)).transpose(0, 2, 1, 3).ravel()
    ang = np.empty((gh * gw, dim), dtype=np.float32)
    ang[:, : dim // 2] = rows.astype(np.float32)[:, None] * inv[None, :]
    ang[:, dim // 2:] = cols.astype(np.float32)[:, None] * inv[None, :]
    return ang
