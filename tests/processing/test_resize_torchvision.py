"""Resize fidelity: ``edgevl.processing.image.resize_torchvision`` and the uint8 bicubic kernel
against torch itself, pixel for pixel.

transformers' torchvision processors (Qwen2-VL images, Qwen3-VL video frames) resize a uint8
tensor with ``torchvision...resize(..., antialias=True)``, which on CPU is
``torch.nn.functional.interpolate(x, size, mode, antialias=True, align_corners=False)`` run on
the uint8 tensor itself. torchvision cannot be installed beside this CPU build of torch, so
the reference here is that interpolate call, on contiguous and on channels-last tensors (torch
may pick another kernel for each layout). Sizes cover upscaling, downscaling, one side up and
the other down, 1-pixel sides, large ratios, flat and high-contrast pictures, one and three
channels."""

import numpy as np
import pytest
import torch
from PIL import Image

from edgevl.errors import EdgevlError
from edgevl.processing import image as imp
from edgevl.processing.image import resize_pil_strips, resize_torchvision, resize_uint8_antialias


def torch_resize(a, oh, ow, mode="bicubic", channels_last=False):
    """uint8 [H, W, C] or [H, W] through torch's uint8 interpolate, back as the same layout."""
    x = torch.from_numpy(np.ascontiguousarray(a if a.ndim == 3 else a[:, :, None]).transpose(2, 0, 1).copy())[None]
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    kw = {"antialias": True, "align_corners": False} if mode in ("bilinear", "bicubic") else {}
    out = torch.nn.functional.interpolate(x, size=(oh, ow), mode=mode, **kw)[0].permute(1, 2, 0).numpy()
    return out if a.ndim == 3 else out[:, :, 0]


# torch's vectorised x86 kernels (what transformers users get on any current x86 CPU)
X86_KERNELS = any(k in torch.backends.cpu.get_cpu_capability() for k in ("AVX2", "AVX512"))


def layouts(oh, ow, channels=3):
    """The torch layouts that are a reference for this output size."""
    # torch trips an internal assert for a contiguous input resized to 1x1; and its generic
    # kernel (CPUs without AVX2) resizes contiguous tensors (one channel: any layout) to a
    # 1-pixel-wide output wrongly, its float path too: there only channels-last RGB is a reference
    if ow == 1 and not X86_KERNELS:
        return (True,) if channels > 1 else ()
    return (True,) if (oh, ow) == (1, 1) else (False, True)


def noise(h, w, c, seed):
    a = np.random.default_rng(seed).integers(0, 256, (h, w, c), dtype=np.uint8)
    return a[:, :, 0] if c == 1 else a


def test_bicubic_random_sizes_both_layouts():
    """Random sizes up, down and mixed, one and three channels, against both torch layouts."""
    rng = np.random.default_rng(3)
    for i in range(150):
        h, w = (int(v) for v in rng.integers(1, 90, 2))
        if i % 3 == 0:     # one side up, the other down
            oh, ow = int(rng.integers(h, 3 * h + 2)), int(rng.integers(1, w + 1))
        else:
            oh, ow = (int(v) for v in rng.integers(1, 160, 2))
        a = noise(h, w, 1 if i % 4 == 0 else 3, seed=i)
        ours = resize_uint8_antialias(a, oh, ow, mode="bicubic")
        for cl in layouts(oh, ow, 1 if a.ndim == 2 else 3):
            np.testing.assert_array_equal(ours, torch_resize(a, oh, ow, channels_last=cl),
                                          err_msg=f"{a.shape} -> {oh}x{ow} channels_last={cl}")


@pytest.mark.parametrize("src,dst", [
    ((1, 1), (37, 53)),        # a single pixel blown up
    ((1, 97), (5, 13)),        # 1-pixel side up, the other down
    ((83, 1), (2, 40)),
    ((61, 47), (1, 47)),       # height only, to one row
    ((61, 47), (61, 1)),       # width only, to one column
    ((7, 5), (700, 3)),        # x100 up, the other down
    ((2000, 3), (7, 9)),       # /285 down, the other up
    ((3, 1500), (450, 2)),     # x150 up and /750 down
    ((123, 457), (123, 300)),  # width only
    ((123, 457), (61, 457)),   # height only
    ((448, 448), (448, 448)),  # unchanged
])
def test_bicubic_edge_sizes(src, dst):
    for c in (1, 3):
        a = noise(*src, c, seed=src[0] + 13 * src[1] + c)
        ours = resize_uint8_antialias(a, *dst, mode="bicubic")
        for cl in layouts(*dst, c):
            np.testing.assert_array_equal(ours, torch_resize(a, *dst, channels_last=cl))


def test_bicubic_axis_weights_many_pairs():
    """One axis at a time over many (in, out) pairs, tall pictures so that one weight off by a
    unit of its int16 would show in some row: the weights, window bounds and precision."""
    rng = np.random.default_rng(5)
    pairs = [(int(i), int(o)) for i, o in rng.integers(1, 70, (500, 2))]
    pairs += [(int(rng.integers(500, 6000)), int(rng.integers(1, 60))) for _ in range(40)]    # far down
    pairs += [(int(rng.integers(1, 8)), int(rng.integers(200, 3000))) for _ in range(40)]     # far up
    pairs += [(int(i), int(i) + d) for i, d in zip(rng.integers(20, 3000, 60), rng.integers(-3, 4, 60)) if d]
    for n_in, n_out in pairs:
        a = noise(48, n_in, 1, seed=n_in * 7919 + n_out)
        t = torch.from_numpy(a)[None, None]
        ref = torch.nn.functional.interpolate(t, size=(48, n_out), mode="bicubic", antialias=True)[0, 0].numpy()
        np.testing.assert_array_equal(resize_uint8_antialias(a, 48, n_out, mode="bicubic"), ref,
                                      err_msg=f"width {n_in} -> {n_out}")
        a = np.ascontiguousarray(a.T)  # the same axis as the vertical pass
        ref = torch.nn.functional.interpolate(t.transpose(2, 3), size=(n_out, 48), mode="bicubic",
                                              antialias=True)[0, 0].numpy()
        np.testing.assert_array_equal(resize_uint8_antialias(a, n_out, 48, mode="bicubic"), ref,
                                      err_msg=f"height {n_in} -> {n_out}")


@pytest.mark.parametrize("value", [0, 1, 128, 254, 255])
def test_bicubic_flat_pictures(value):
    a = np.full((45, 77, 3), value, np.uint8)
    for oh, ow in ((64, 96), (13, 11), (90, 30)):
        ours = resize_uint8_antialias(a, oh, ow, mode="bicubic")
        np.testing.assert_array_equal(ours, torch_resize(a, oh, ow))


def test_bicubic_overshoot_is_clamped_in_both_passes():
    """A 0/255 checkerboard rings far past 0..255 with a cubic: torch clamps the uint8
    intermediate after the horizontal pass, then the output."""
    a = ((np.indices((33, 29)).sum(0) % 2) * 255).astype(np.uint8)[:, :, None].repeat(3, 2)
    for oh, ow in ((100, 87), (20, 90), (90, 20), (16, 14)):
        ours = resize_uint8_antialias(a, oh, ow, mode="bicubic")
        np.testing.assert_array_equal(ours, torch_resize(a, oh, ow))
    assert {0, 255} <= set(np.unique(resize_uint8_antialias(a, 100, 87, mode="bicubic")).tolist())


def test_pil_strips_and_row_blocks(monkeypatch):
    """A PIL image read in strips, and arrays in many row blocks: the same pixels as torch."""
    a = noise(203, 131, 3, seed=9)
    ref = torch_resize(a, 96, 224)
    monkeypatch.setattr(imp, "_BLOCK_ELEMS", 1000)
    im = Image.fromarray(a)
    np.testing.assert_array_equal(resize_pil_strips(im, 96, 224, mode="bicubic"), ref)
    np.testing.assert_array_equal(resize_torchvision(im, 96, 224, Image.BICUBIC), ref)
    np.testing.assert_array_equal(resize_torchvision(a, 96, 224, 3), ref)
    np.testing.assert_array_equal(resize_torchvision(a[:, :, 1], 96, 224, 3), ref[:, :, 1])
    np.testing.assert_array_equal(resize_torchvision(im, 96, 224, Image.BILINEAR), torch_resize(a, 96, 224, "bilinear"))


def test_default_mode_is_still_bilinear():
    a = noise(50, 70, 3, seed=1)
    np.testing.assert_array_equal(resize_uint8_antialias(a, 33, 91), torch_resize(a, 33, 91, "bilinear"))
    np.testing.assert_array_equal(resize_pil_strips(Image.fromarray(a), 33, 91), torch_resize(a, 33, 91, "bilinear"))


def test_nearest_is_torch_nearest_exact():
    """Pillow's NEAREST is nearest-exact in transformers' torchvision backend; torch has one
    kernel for small outputs (height + width <= 128) and another above."""
    rng = np.random.default_rng(2)
    sizes = [(int(h), int(w), int(oh), int(ow)) for h, w, oh, ow in rng.integers(1, 300, (120, 4))]
    sizes += [(h, w, oh, ow) for h, w, oh, ow in rng.integers(1, 90, (120, 4)).tolist()]   # small outputs
    sizes += [(3, 7, 2000, 9), (4999, 3, 11, 700), (640, 480, 64, 64), (640, 480, 65, 64)]
    if X86_KERNELS:   # exact ties that torch's x86 builds round through an FMA
        sizes += [(5, 2, 10, 141), (6, 8, 165, 188), (4, 6, 194, 30)]
    for h, w, oh, ow in sizes:
        a = noise(h, w, 3, seed=h * 31 + w)
        np.testing.assert_array_equal(resize_torchvision(a, oh, ow, Image.NEAREST),
                                      torch_resize(a, oh, ow, "nearest-exact"), err_msg=str((h, w, oh, ow)))
    a = noise(301, 211, 3, seed=4)
    np.testing.assert_array_equal(resize_torchvision(Image.fromarray(a), 150, 500, 0),
                                  torch_resize(a, 150, 500, "nearest-exact"))


def test_pillow_filters_and_unchanged_sizes():
    a = noise(40, 60, 3, seed=2)
    im = Image.fromarray(a)
    for code in (Image.LANCZOS, Image.BOX, Image.HAMMING):
        np.testing.assert_array_equal(resize_torchvision(im, 25, 77, code),
                                      np.asarray(im.resize((77, 25), resample=code)))
    out = resize_torchvision(a, 40, 60, 3)
    np.testing.assert_array_equal(out, a)
    assert out is not a


@pytest.mark.parametrize("call,msg", [
    (lambda: resize_torchvision(np.zeros((4, 4, 3), np.uint8), 2, 2, 7), "Unsupported resample value 7"),
    (lambda: resize_torchvision(np.zeros((4, 4, 3), np.uint8), 2, 2, "3"), "Unsupported resample value"),
    (lambda: resize_torchvision(np.zeros((4, 4, 3), np.uint8), 2, 2, True), "Unsupported resample value"),
    (lambda: resize_torchvision(np.zeros((4, 4, 3), np.uint8), 2, 2, 2.5), "Unsupported resample value"),
    (lambda: resize_torchvision(np.zeros((4, 4, 3), np.float32), 2, 2, 3), "uint8"),
    (lambda: resize_torchvision(np.zeros((0, 4, 3), np.uint8), 2, 2, 3), "non-empty"),
    (lambda: resize_torchvision(np.zeros((4, 4, 3), np.uint8), 0, 2, 3), "must be >= 1"),
    (lambda: resize_torchvision(Image.new("L", (4, 4)), 2, 2, 3), "needs an RGB PIL image"),
    (lambda: resize_torchvision(np.zeros((4, 4, 7), np.uint8), 2, 2, 1), "7-channel"),
    (lambda: resize_uint8_antialias(np.zeros((4, 4, 3), np.uint8), 2, 2, mode="lanczos"), "Unknown resize mode"),
    (lambda: resize_pil_strips(Image.new("RGB", (4, 4)), 2, 2, mode="cubic"), "Unknown resize mode"),
])
def test_bad_input_is_a_one_line_error(call, msg):
    with pytest.raises(EdgevlError, match=msg) as e:
        call()
    assert "\n" not in str(e.value)
