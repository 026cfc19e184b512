"""Youtu-VL's image processor (edgevl/models/youtu_vl/processing.py on edgevl.processing.image)
against PyTorch, which is what the HF processor runs: target size, resize, pixel values, windows,
the vision rotary angles, other patch and merge sizes, and no torch in the processing modules.
Sections are those of docs/models/youtu_vl.md (3: the processor,
4.3: windows, 4.4: the 2-D rotary embedding)."""

import ast
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from edgevl.errors import EdgevlError
from edgevl.models.youtu_vl import processing as siglip2
from edgevl.models.youtu_vl.processing import (
    apply_window_order,
    preprocess,
    restore_order,
    target_size,
    vision_rope_angles,
    window_partition,
)
from edgevl.processing import image as imp
from edgevl.processing.image import resize_uint8_antialias
from support.common import noise_pixels

F32_ULP_AT_1 = float(np.spacing(np.float32(1.0)))


def _torch_resize(a, oh, ow, channels_last=False):
    t = torch.from_numpy(a).permute(2, 0, 1)[None]
    t = t.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    out = torch.nn.functional.interpolate(
        t, size=(oh, ow), mode="bilinear", antialias=True, align_corners=False
    )
    return out[0].permute(1, 2, 0).numpy()


def _torch_pixel_values(a, th, tw):
    """Reference pipeline: HF fast path (uint8 resize, fused rescale+normalise, section 3.5 patchify)."""
    x = torch.from_numpy(np.ascontiguousarray(a)).permute(2, 0, 1)[None]
    x = torch.nn.functional.interpolate(
        x, size=(th, tw), mode="bilinear", antialias=True, align_corners=False
    )[0]
    # transformers fuses rescale_factor into mean/std: 0.5 * (1 / (1/255)) in float32
    mean = (torch.tensor([0.5, 0.5, 0.5]) * (1.0 / (1 / 255))).view(3, 1, 1)
    std = (torch.tensor([0.5, 0.5, 0.5]) * (1.0 / (1 / 255))).view(3, 1, 1)
    fused = (x.to(torch.float32) - mean) / std
    unfused = (x.to(torch.float32) * (1 / 255) - 0.5) / 0.5
    gh, gw = th // 16, tw // 16

    def patchify(v):  # (ch, R, mh, py, C, mw, px) -> (R, C, mh, mw, py, px, ch)
        v = v.reshape(3, gh // 2, 2, 16, gw // 2, 2, 16).permute(1, 4, 2, 5, 3, 6, 0)
        return v.reshape(gh * gw, 768).numpy()

    return patchify(fused), patchify(unfused)


# ---------------------------------------------------------------------------------- section 3.2


@pytest.mark.parametrize(
    "hw, expected",
    [
        ((480, 640), (480, 640)),
        ((720, 1280), (736, 1280)),
        ((1080, 1920), (1088, 1920)),
        ((2000, 2000), (2016, 2016)),
        ((3024, 4032), (2624, 3488)),
        ((100, 50), (128, 64)),
        ((2800, 8108), (1792, 5216)),  # float32 arithmetic would give 1760x5056
        ((1, 1), (32, 32)),
        ((5, 10), (32, 32)),
    ],
)
def test_target_size_spec_examples(hw, expected):
    assert target_size(*hw) == expected


def test_target_size_invariants():
    rng = np.random.default_rng(3)
    for _ in range(300):
        h, w = (int(v) for v in rng.integers(1, 9000, 2))
        budget = int(rng.choice([256, 1024, 36864]))
        th, tw = target_size(h, w, budget)
        assert th % 32 == 0 and tw % 32 == 0 and th >= 32 and tw >= 32
        assert (th // 16) * (tw // 16) <= budget
        if (math.ceil(h / 32) * 2) * (math.ceil(w / 32) * 2) <= budget:
            assert (th, tw) == (math.ceil(h / 32) * 32, math.ceil(w / 32) * 32)  # scale 1.0


def test_target_size_errors():
    with pytest.raises(EdgevlError, match="max_image_patches"):
        target_size(100, 100, 3)
    with pytest.raises(EdgevlError, match="cannot be fitted"):
        target_size(2000, 2000, 4)  # still 64x64 at scale 0.02
    with pytest.raises(EdgevlError, match="positive integer"):
        target_size(0, 10)
    assert target_size(2000, 2000, 16) == (64, 64)  # scale 0.02 fits a 16-patch budget
    assert target_size(40, 40, 4) == (32, 32)


# ---------------------------------------------------------------------------------- section 3.3


RESIZE_PAIRS = [
    ((1001, 37), target_size(1001, 37)),  # width 37, height 1001
    ((37, 1001), target_size(37, 1001)),  # the transpose
    ((100, 50), target_size(100, 50)),
    ((50, 100), target_size(50, 100)),
    ((480, 640), target_size(480, 640)),  # unchanged: plain copy
    ((480, 640), target_size(480, 640, 256)),  # downscaled by a small patch budget
    ((3024, 4032), (96, 128)),  # strong downscale, many taps
    ((5, 10), (32, 32)),  # upscale of a tiny image
    ((1, 9), (32, 64)),  # 1xN
    ((9, 1), (64, 32)),  # Nx1
    ((1, 1), (32, 32)),
    ((123, 457), (123, 300)),  # width only
    ((123, 457), (61, 457)),  # height only
    ((301, 199), (33, 77)),  # odd sizes
    ((333, 777), (1000, 2000)),  # upscale both
    ((2, 2), (1, 1)),
]


@pytest.mark.parametrize("src, dst", RESIZE_PAIRS)
def test_resize_bit_exact_vs_torch(src, dst):
    a = noise_pixels(*src, seed=src[0] * 7 + src[1])
    out = resize_uint8_antialias(a, *dst)
    assert out.dtype == np.uint8 and out.shape == (*dst, 3)
    # torch 2.13 trips an internal assert for a contiguous-format input with a 1x1 output
    for cl in (False, True) if dst != (1, 1) else (True,):
        ref = _torch_resize(a, *dst, channels_last=cl)
        assert int(np.abs(out.astype(np.int16) - ref).max()) == 0


def test_resize_random_sizes_bit_exact():
    rng = np.random.default_rng(11)
    for i in range(60):
        h, w = (int(v) for v in rng.integers(1, 200, 2))
        oh, ow = (int(v) for v in rng.integers(1, 260, 2))
        a = noise_pixels(h, w, seed=i)
        assert np.array_equal(resize_uint8_antialias(a, oh, ow), _torch_resize(a, oh, ow)), (h, w, oh, ow)


def test_resize_small_blocks_and_grey(monkeypatch):
    # Force many row blocks: block boundaries must not change any pixel.
    a = noise_pixels(97, 203, seed=5)
    ref = _torch_resize(a, 64, 96)
    monkeypatch.setattr(imp, "_BLOCK_ELEMS", 1000)
    assert np.array_equal(resize_uint8_antialias(a, 64, 96), ref)
    grey = resize_uint8_antialias(a[:, :, 0], 64, 96)
    assert grey.shape == (64, 96) and np.array_equal(grey, ref[:, :, 0])


def test_resize_rejects_bad_arrays():
    with pytest.raises(EdgevlError, match="uint8"):
        resize_uint8_antialias(np.zeros((4, 4, 3), np.float32), 2, 2)
    with pytest.raises(EdgevlError):
        resize_uint8_antialias(np.zeros((4, 4, 3), np.uint8), 0, 2)


# ----------------------------------------------------------------------------- sections 3.4-3.5


@pytest.mark.parametrize(
    "hw, budget",
    [((1001, 37), 36864), ((37, 1001), 36864), ((100, 50), 36864), ((480, 640), 36864),
     ((480, 640), 256), ((5, 10), 36864)],
)
def test_pixel_values_bit_exact_vs_torch(hw, budget):
    a = noise_pixels(*hw, seed=hw[0] + hw[1])
    out = preprocess(Image.fromarray(a), max_image_patches=budget)
    th, tw = target_size(*hw, budget)
    gh, gw = th // 16, tw // 16
    assert out["image_size"] == hw
    assert out["resized_size"] == (th, tw)
    assert out["spatial_shapes"] == (gh, gw)
    assert out["num_image_tokens"] == gh * gw // 4
    pv = out["pixel_values"]
    assert pv.dtype == np.float32 and pv.shape == (gh * gw, 768)
    fused, unfused = _torch_pixel_values(a, th, tw)
    assert np.array_equal(pv, fused)  # the HF fast path (u - 127.5) / 127.5, bit-exact
    # the unfused formula (u/255 - 0.5)/0.5 differs by at most 1 ulp of 1.0 (section 3.4)
    assert float(np.abs(pv - unfused).max()) <= F32_ULP_AT_1
    # deterministic
    assert np.array_equal(preprocess(Image.fromarray(a), max_image_patches=budget)["pixel_values"], pv)


def test_pixel_values_layout_by_hand():
    """The section 3.5 loop, element by element, independent of any reshape."""
    a = noise_pixels(64, 96, seed=9)  # already aligned: no resize, so pixels are the input's
    pv = preprocess(Image.fromarray(a))["pixel_values"]
    gh, gw = 4, 6
    rng = np.random.default_rng(0)
    n = 0
    for R in range(gh // 2):
        for C in range(gw // 2):
            for mh in range(2):
                for mw in range(2):
                    for py, px, ch in rng.integers(0, [16, 16, 3], (5, 3)):
                        u = float(a[16 * (2 * R + mh) + py, 16 * (2 * C + mw) + px, ch])
                        assert pv[n, (py * 16 + px) * 3 + ch] == np.float32((u - 127.5) / 127.5)
                    n += 1
    assert n == gh * gw


def test_preprocess_path_equals_pil(tmp_path):
    a = noise_pixels(70, 45, seed=2)
    p = tmp_path / "x.png"
    Image.fromarray(a).save(p)
    assert np.array_equal(preprocess(p)["pixel_values"], preprocess(Image.fromarray(a))["pixel_values"])
    assert np.array_equal(preprocess(str(p))["pixel_values"], preprocess(Image.fromarray(a))["pixel_values"])


# ---------------------------------------------------------------------------------- section 4.3


def _hf_style_window_index(gh, gw, ws_cells):
    """Independent formulation: pad the merged grid with -100 to whole windows, drop pads."""
    hm, wm = gh // 2, gw // 2
    ph, pw = -hm % ws_cells, -wm % ws_cells
    ids = np.pad(np.arange(hm * wm).reshape(hm, wm), ((0, ph), (0, pw)), constant_values=-100)
    nh, nw = (hm + ph) // ws_cells, (wm + pw) // ws_cells
    win = ids.reshape(nh, ws_cells, nw, ws_cells).transpose(0, 2, 1, 3).reshape(nh * nw, -1)
    counts = (win != -100).sum(1)
    index = win[win != -100]
    cu = np.concatenate([[0], np.cumsum(counts * 4)])
    return index, cu


def test_window_partition_spec_examples():
    idx, cu = window_partition(36, 20)
    assert cu.tolist() == [0, 256, 320, 576, 640, 704, 720]
    assert idx[:16].tolist() == list(range(0, 8)) + list(range(10, 18))
    assert idx.dtype == np.int64 and cu.dtype == np.int64
    assert window_partition(30, 40)[1].tolist() == [0, 256, 512, 640, 864, 1088, 1200]
    idx, cu = window_partition(16, 16)
    assert cu.tolist() == [0, 256] and idx.tolist() == list(range(64))


@pytest.mark.parametrize("gh, gw, window_size", [(36, 20, 256), (30, 40, 256), (2, 2, 256),
                                                 (164, 218, 256), (6, 10, 64), (8, 8, 32)])
def test_window_partition_matches_padding_formulation(gh, gw, window_size):
    idx, cu = window_partition(gh, gw, window_size=window_size)
    ref_idx, ref_cu = _hf_style_window_index(gh, gw, window_size // 32)
    assert idx.tolist() == ref_idx.tolist() and cu.tolist() == ref_cu.tolist()
    assert sorted(idx.tolist()) == list(range(gh * gw // 4))  # a permutation
    assert cu[-1] == gh * gw


def test_window_order_roundtrip():
    gh, gw = 36, 20
    idx, _ = window_partition(gh, gw)
    x = np.random.default_rng(1).standard_normal((gh * gw, 5)).astype(np.float32)
    xw = apply_window_order(x, idx)
    for k in (0, 7, 8, 100, len(idx) - 1):
        for u in range(4):
            assert np.array_equal(xw[4 * k + u], x[4 * idx[k] + u])
    assert np.array_equal(restore_order(xw, idx), x)
    # also works on torch tensors (the model code may hold those)
    t = torch.from_numpy(x)
    assert torch.equal(restore_order(apply_window_order(t, idx), idx), t)
    with pytest.raises(EdgevlError):
        apply_window_order(x[:-1], idx)


def test_window_partition_bad_grid():
    with pytest.raises(EdgevlError):
        window_partition(5, 4)
    with pytest.raises(EdgevlError):
        window_partition(4, 4, window_size=16)


# ---------------------------------------------------------------------------------- section 4.4


def test_vision_rope_angles_by_hand():
    gh, gw = 36, 20
    ang = vision_rope_angles(gh, gw)
    assert ang.dtype == np.float32 and ang.shape == (gh * gw, 36)
    inv = [10000.0 ** (-j / 18) for j in range(18)]
    wm = gw // 2
    for R, C, mh, mw in [(0, 0, 0, 0), (0, 0, 1, 1), (3, 7, 1, 0), (17, 9, 1, 1)]:
        p = 4 * (R * wm + C) + 2 * mh + mw
        r, c = 2 * R + mh, 2 * C + mw
        for j in (0, 1, 5, 17):
            assert ang[p, j] == pytest.approx(r * inv[j], rel=1e-6, abs=1e-7)
            assert ang[p, 18 + j] == pytest.approx(c * inv[j], rel=1e-6, abs=1e-7)
    # the last patch is at row 35, column 19
    assert ang[-1, 0] == 35 and ang[-1, 18] == 19


@pytest.mark.parametrize("gh, gw, head_dim", [(36, 20, 72), (4, 6, 16), (16, 16, 72)])
def test_vision_rope_angles_match_torch_float32(gh, gw, head_dim):
    dim = head_dim // 2  # HF VisionRotaryEmbedding(dim=head_dim/2), float32 throughout
    inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    table = torch.outer(torch.arange(max(gh, gw), dtype=torch.float), inv)
    hpos = torch.arange(gh)[:, None].expand(gh, gw)
    wpos = torch.arange(gw)[None, :].expand(gh, gw)

    def merge_order(t):
        return t.reshape(gh // 2, 2, gw // 2, 2).permute(0, 2, 1, 3).flatten()

    ref = torch.cat([table[merge_order(hpos)], table[merge_order(wpos)]], dim=1).numpy()
    assert np.array_equal(vision_rope_angles(gh, gw, head_dim), ref)


@pytest.mark.parametrize("module", [imp, siglip2])
def test_module_does_not_import_torch(module):
    tree = ast.parse(Path(module.__file__).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):  # a relative import (from .image ...) stays in edgevl
            names.add("edgevl" if node.level else node.module.split(".")[0])
    assert "torch" not in names and names <= {"__future__", "base64", "binascii", "io", "math", "os", "re",
                                              "warnings", "pathlib", "typing", "collections", "urllib", "numpy",
                                              "PIL", "edgevl"}


def test_generic_patch_and_merge_sizes():
    # tiny test models use other sizes: patch 8, merge 2 -> 16 px alignment, 192-wide patches
    a = noise_pixels(40, 70, seed=12)
    out = preprocess(Image.fromarray(a), max_image_patches=64, patch_size=8, merge_size=2)
    th, tw = target_size(40, 70, 64, patch_size=8, merge_size=2)
    assert out["resized_size"] == (th, tw) and th % 16 == 0 and tw % 16 == 0
    gh, gw = out["spatial_shapes"]
    assert out["pixel_values"].shape == (gh * gw, 192) and gh * gw <= 64
    r = resize_uint8_antialias(a, th, tw)
    # first group's top-right patch (R=0, C=0, mh=0, mw=1), pixel (py=0, px=0, ch=1)
    assert out["pixel_values"][1, 1] == (np.float32(r[0, 8, 1]) - 127.5) / np.float32(127.5)
    idx, cu = window_partition(gh, gw, window_size=32, patch_size=8, merge_size=2)
    assert cu[-1] == gh * gw and sorted(idx.tolist()) == list(range(gh * gw // 4))
    assert vision_rope_angles(gh, gw, head_dim=16).shape == (gh * gw, 8)
