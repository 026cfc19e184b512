"""Rotary position embeddings: the tables a decoder graph's ``rope_cos``/``rope_sin`` inputs take.

Plain 1-D RoPE (Youtu-LLM, Youtu-VL) and interleaved multimodal RoPE (M-RoPE: Qwen3.5's family
and the Youtu MoE), whose positions run along three axes (time, height, width) so that an image's
tokens sit on a 2-D grid (docs/models/qwen3_5.md, "Positions"). Positions are computed on the
host for a whole prompt; decoding continues at max(position) + 1.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from ..errors import EdgevlError


def rope_parameters_of(cfg: dict) -> tuple[dict, str]:
    """The RoPE settings as transformers reads them, and the field they came from: a config in
    the older layout keeps them in ``rope_scaling`` (M-RoPE's sections too), which then replaces
    ``rope_parameters`` whole; a key neither holds comes from the config's top level."""
    rp = cfg.get("rope_parameters") or {}
    rs = cfg.get("rope_scaling") or {}
    for key, v in (("rope_parameters", rp), ("rope_scaling", rs)):
        if not isinstance(v, dict):
            raise EdgevlError(f"config.json field {key} must be an object or null, got {type(v).__name__}; fix "
                              "the checkpoint's config")
    return (rs, "rope_scaling") if rs else (rp, "rope_parameters")


def rope_theta_of(cfg: dict, default: float = 10000.0) -> float:
    """The checkpoint's own RoPE base: ``rope_parameters`` (transformers 5), ``rope_scaling``
    (the older layout) or ``rope_theta``."""
    used, _ = rope_parameters_of(cfg)
    rp = cfg.get("rope_parameters") or {}
    rs = cfg.get("rope_scaling") or {}
    # every place a scaling may be named: a rope_scaling added beside rope_parameters (a usual
    # "longer context" edit) would otherwise be ignored, and the answers silently differ
    named = [t for t in (rp.get("rope_type"), rs.get("rope_type"), rs.get("type")) if t is not None]
    rtype = next((t for t in named if t != "default"), "default")
    if rtype != "default":
        raise EdgevlError(f"rope_type {rtype!r:.60} in config.json is not supported yet (only plain RoPE); "
                          "please open an issue with the checkpoint name")
    theta = used.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        return float(default)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        raise EdgevlError(f"config.json field rope_theta must be a positive number, got {theta!r:.60}; fix the "
                          "checkpoint's config")
    return float(theta)


def rope_tables(positions: np.ndarray, dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [len(positions), dim/2] for plain 1-D RoPE, float32 as transformers computes it."""
    inv = (1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))).astype(np.float32)
    ang = np.asarray(positions, dtype=np.float32)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def rope_positions(input_ids, grids, image_token_id: int, merge: int) -> np.ndarray:
    """M-RoPE positions [3, len(input_ids)] as transformers' ``get_rope_index``: text advances all
    three axes together; the k-th run of image tokens takes the k-th grid (t, h, w in patches) and
    gets T = s, H = s + row, W = s + col on the merged grid; text after it resumes at
    s + max(h, w) / merge. Decoding continues at max(positions) + 1."""
    ids = np.asarray(input_ids, np.int64).reshape(-1)
    out, pos, k = [], 0, 0
    grids = list(grids or [])
    for is_image, run in itertools.groupby(ids == image_token_id):
        n = len(list(run))
        if not is_image:
            out.append(np.broadcast_to(np.arange(pos, pos + n), (3, n)))
            pos += n
            continue
        if k >= len(grids):
            raise EdgevlError(f"the prompt has more image-token runs than images ({len(grids)}); give one "
                              "image per <|vision_start|><|image_pad|>...<|vision_end|> block")
        t, h, w = (int(x) for x in grids[k])
        gh, gw = h // merge, w // merge
        if n != t * gh * gw:
            raise EdgevlError(f"image {k + 1}: the prompt has {n} image tokens but the image gives {t * gh * gw}; "
                              "expand each <|image_pad|> to the image's token count")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        out.append(np.stack([tt.ravel() + pos, hh.ravel() + pos, ww.ravel() + pos]))
        pos += max(gh, gw)
        k += 1
    if k != len(grids):
        raise EdgevlError(f"{len(grids)} images were given but the prompt has {k} image-token runs")
    return np.concatenate(out, 1) if out else np.zeros((3, 0), np.int64)


def mrope_tables(positions: np.ndarray, rot_dim: int, theta: float, section) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [seq, rot_dim/2] of interleaved M-RoPE (``Qwen3_5TextRotaryEmbedding``): frequency j
    takes the H position at j = 1, 4, ... < 3*section[1], W at j = 2, 5, ... < 3*section[2], T
    elsewhere; float32 as transformers computes them."""
    inv = (1.0 / (theta ** (np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim))).astype(np.float32)
    p = np.broadcast_to(np.asarray(positions), (3, np.shape(positions)[-1])).astype(np.float32)
    freqs = p[:, :, None] * inv[None, None, :]
    f = freqs[0].copy()
    for axis in (1, 2):
        idx = slice(axis, 3 * section[axis], 3)
        f[:, idx] = freqs[axis][:, idx]
    return np.cos(f).astype(np.float32), np.sin(f).astype(np.float32)


def rope_1d(info: dict):
    """positions [1, seq] -> (cos, sin) of plain RoPE with the decoder manifest's ``rope_dim`` and
    ``rope_theta`` (checked: a damaged manifest fails in one line)."""
    dim, theta = info["extra"]["rope_dim"], info["extra"]["rope_theta"]
    for what, v, kind in (("rope_dim", dim, int), ("rope_theta", theta, (int, float))):
        if isinstance(v, bool) or not isinstance(v, kind) or not v > 0:
            raise EdgevlError(f"manifest.json graphs.decoder.extra.{what} must be a positive number, got "
                              f"{v!r:.40}; convert the model again")
    return lambda positions: rope_tables(positions[0], dim, theta)


def mrope(info: dict):
    """positions [3, seq] -> (cos, sin) of interleaved M-RoPE with the decoder manifest's
    ``rope`` entry (``dim``, ``theta``, ``mrope_section``), checked."""
    r = info["extra"].get("rope") or {}
    dim, theta, section = r.get("dim"), r.get("theta"), r.get("mrope_section")
    if not (isinstance(dim, int) and dim > 0 and isinstance(theta, (int, float)) and theta > 0
            and isinstance(section, list) and len(section) == 3 and sum(section) * 2 == dim):
        raise EdgevlError(f"manifest.json graphs.decoder.extra.rope is malformed ({r!r:.80}); convert the model again")
    return lambda positions: mrope_tables(positions, dim, theta, section)


def mrope_positions_of(input_ids, images, image_token_id) -> np.ndarray:
    """M-RoPE positions of a prompt from its images' processor infos (``grid_thw``, ``merge_size``)."""
    grids, merge = [], 2
    for k, info in enumerate(images):
        if not isinstance(info, dict) or "grid_thw" not in info:
            raise EdgevlError(f"image {k + 1}: M-RoPE needs the image's grid; pass images as paths/PIL images, "
                              "or as the (rows, info) pairs Model.encode_image returns")
        grids.append(info["grid_thw"])
        merge = int(info.get("merge_size", merge))
    return rope_positions(input_ids, grids, -1 if image_token_id is None else image_token_id, merge)
