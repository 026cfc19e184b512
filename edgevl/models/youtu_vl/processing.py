"""Youtu-VL's image processor (a customised ``Siglip2ImageProcessorFast`` driven by
``YoutuVLProcessor``) in numpy + Pillow, bit for bit, plus the index/angle tables its vision
tower needs:

* :func:`target_size`: the "fit to max patches" step search [3.2].
* :func:`preprocess`: resize (torch's uint8 antialiased bilinear, ``image.py``), normalise and
  patchify in 2x2-merge order [3.3-3.5].
* :func:`window_partition`, :func:`apply_window_order`, :func:`restore_order`: window
  grouping [4.3, 4.6].
* :func:`vision_rope_angles`: the 2-D RoPE angle table [4.4].

Numbers in brackets, e.g. [3.2], are sections of docs/models/youtu_vl.md.
"""

from __future__ import annotations

import math

import numpy as np

from ...errors import EdgevlError
from ...processing.image import MAX_IMAGE_PATCHES, load_image, resize_pil_strips

__all__ = [
    "target_size",
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

# [3.7]: the processor call overrides preprocessor_config's 256 with 36864.
DEFAULT_MAX_IMAGE_PATCHES = 36864
PATCH_SIZE = 16
MERGE_SIZE = 2


# --------------------------------------------------------------------------------------------
# [3.2] Target size
# --------------------------------------------------------------------------------------------


def target_size(
    height: int,
    width: int,
    max_image_patches: int = DEFAULT_MAX_IMAGE_PATCHES,
    patch_size: int = PATCH_SIZE,
    merge_size: int = MERGE_SIZE,
) -> tuple[int, int]:
    """Resized (height, width): both multiples of patch*merge, rounded up, shrunk in 0.02 steps
    of ``scale`` until the patch count fits ``max_image_patches`` [3.2].

    The arithmetic is Python float64 on purpose: float32 picks a different size for ~0.5 % of
    inputs [3.2, 12.8].
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
# [3.4-3.5] Normalise and patchify
# --------------------------------------------------------------------------------------------

# [3.4]: the HF fast path fuses rescale (1/255) and normalise (0.5, 0.5) into mean = std = 127.5
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
    """Turn one image (path or PIL image) into the vision tower's input [3].

    Returns a dict with
      * ``pixel_values``: float32 [N, patch*patch*3], patches in merge-group order, channel-last
        inside a patch [3.5]; HF's tensor is this with a leading batch axis of 1;
      * ``spatial_shapes``: (gh, gw) in patches, height first; N = gh*gw;
      * ``image_size``: original (H, W); ``resized_size``: (th, tw);
      * ``num_image_tokens``: N / merge^2, the number of <|image_pad|> tokens.
    """
    im = load_image(image)
    h, w = im.height, im.width
    th, tw = target_size(h, w, max_image_patches, patch_size, merge_size)
    resized = resize_pil_strips(im, th, tw)  # [th, tw, 3] uint8

    p, m = patch_size, merge_size
    gh, gw = th // p, tw // p
    # (R, mh, py, C, mw, px, ch) -> (R, C, mh, mw, py, px, ch): merge groups in raster order,
    # TL/TR/BL/BR inside a group, channel-last inside a patch [3.5]. Done on uint8 (cheap),
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
# [4.3] Window grouping and [4.4] rotary angles
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
    """(window_index, cu_window_seqlens) for one image, both int64 [4.3].

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
    merge 2) [4.3]. Works for numpy arrays and anything with numpy-style indexing."""
    idx = np.asarray(window_index, dtype=np.int64)
    return _group_view(x, idx.size)[idx].reshape(x.shape)


def restore_order(x_win, window_index):
    """Inverse of :func:`apply_window_order` [4.6]: gather with argsort(window_index)."""
    inv = np.argsort(np.asarray(window_index, dtype=np.int64), kind="stable")
    return _group_view(x_win, inv.size)[inv].reshape(x_win.shape)


def vision_rope_angles(
    gh: int,
    gw: int,
    head_dim: int = 72,
    theta: float = 10000.0,
    merge_size: int = MERGE_SIZE,
) -> np.ndarray:
    """float32 [N, head_dim/2] rotary angles in processor (merge-group) order [4.4].

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
