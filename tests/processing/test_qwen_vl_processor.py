"""The Qwen2-VL image processor in numpy + Pillow against transformers' default (torchvision)
Qwen2VLImageProcessor, rebuilt without torchvision (``edgevl.verification.reference.
qwen_image_processor``: torch's uint8 interpolate for the resize, float32 fused rescale and
normalize), and the host-side tables of Qwen3.5 (M-RoPE positions and angles, vision RoPE,
resampled position table) against transformers' own functions."""

import numpy as np
import pytest
import torch
from PIL import Image

from edgevl.blocks import qwen_vision, rope
from edgevl.errors import EdgevlError
from edgevl.processing import qwen_vl
from edgevl.verification.families.qwen3_5 import TINY_PREPROCESSOR as PREPROCESSOR
from edgevl.verification.reference import qwen_image_processor
from support.common import smooth_image


def _hf(cfg: dict, img):
    ip = qwen_image_processor(**{k: v for k, v in cfg.items() if k not in ("image_processor_type", "processor_class")})
    enc = ip(images=[img], return_tensors="np")
    return enc["pixel_values"], tuple(int(x) for x in enc["image_grid_thw"][0])


CFGS = {
    "tiny-ckpt": PREPROCESSOR,
    # the Qwen3-VL defaults, spelled with the old keys, mean/std 0.5
    "min_max_pixels": dict(patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=65536,
                           max_pixels=16777216, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]),
    "patch14": dict(patch_size=14, merge_size=2, size={"shortest_edge": 3136, "longest_edge": 50176}),
    # rescale or normalize alone, and a rescale factor other than 1/255
    "rescale-only": dict(PREPROCESSOR, do_normalize=False),
    "normalize-only": dict(PREPROCESSOR, do_rescale=False, image_mean=[120.5, 115, 104], image_std=[68.5, 66.6, 70.3]),
    "rescale-1/127.5": dict(PREPROCESSOR, rescale_factor=1 / 127.5, image_mean=[0.48145466, 0.4578275, 0.40821073],
                            image_std=[0.26862954, 0.26130258, 0.27577711]),
}
SIZES = [(37, 1001), (100, 50), (640, 480), (10, 5), (208, 208), (1500, 500)]


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
@pytest.mark.parametrize("cfg", list(CFGS))
def test_pixel_values_bit_exact(cfg, size):
    img = smooth_image(*size, seed=size[0])
    ref, grid = _hf(CFGS[cfg], img)
    ours = qwen_vl.preprocess(img, qwen_vl.ProcessorConfig.from_dict(CFGS[cfg]))
    assert ours["grid_thw"] == grid
    assert ours["pixel_values"].dtype == np.float32
    np.testing.assert_array_equal(ours["pixel_values"], ref)
    assert ours["num_image_tokens"] * 4 == grid[1] * grid[2]


def test_resize_is_torch_uint8_bicubic():
    """The resized pixels before rescaling: torch's interpolate on the uint8 tensor, as
    transformers' torchvision resize runs it (not Pillow's BICUBIC)."""
    img = smooth_image(173, 91, seed=4)
    th, tw = qwen_vl.smart_resize(91, 173, 32, 4096, 16384)
    cfg = qwen_vl.ProcessorConfig.from_dict(dict(PREPROCESSOR, do_rescale=False, do_normalize=False,
                                                 size={"shortest_edge": 4096, "longest_edge": 16384}))
    ours = qwen_vl.preprocess(img, cfg)["pixel_values"]
    t = torch.from_numpy(np.array(img)).permute(2, 0, 1)[None].contiguous()
    px = torch.nn.functional.interpolate(t, size=(th, tw), mode="bicubic", antialias=True, align_corners=False)
    want = qwen_vl.patchify(px[0].numpy().astype(np.float32), 16, 2, 2)
    np.testing.assert_array_equal(ours, want)


@pytest.mark.parametrize("mean,std,factor", [
    ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5], 1 / 255),
    ([0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711], 1 / 255),
    ([0.1, 0.7, 0.33], [0.9, 0.05, 1.7], 0.0038),
])
def test_rescale_normalize_is_the_fused_float32_step(mean, std, factor):
    """All 256 levels through transformers' fused step written out in torch: mean and std times
    1 / rescale_factor in float32, then (x - mean) / std in float32."""
    x = np.broadcast_to(np.arange(256, dtype=np.uint8)[None, :, None], (3, 256, 4)).copy()
    cfg = qwen_vl.ProcessorConfig(image_mean=mean, image_std=std, rescale_factor=factor)
    m = (torch.tensor(mean) * (1.0 / factor)).view(-1, 1, 1)
    s = (torch.tensor(std) * (1.0 / factor)).view(-1, 1, 1)
    want = (torch.from_numpy(x).to(torch.float32) - m) / s
    np.testing.assert_array_equal(qwen_vl.rescale_normalize(x, cfg), want.numpy())


def test_smart_resize_rules():
    assert qwen_vl.smart_resize(208, 208, 32, 1, 10 ** 9) == (192, 192)     # round() halves to even
    h, w = qwen_vl.smart_resize(10, 5, 32, 4096, 10 ** 9)                   # scaled up, ceil
    assert h * w >= 4096 and h % 32 == 0 and w % 32 == 0
    h, w = qwen_vl.smart_resize(9000, 12000, 32, 4096, 131072)              # scaled down, floor
    assert h * w <= 131072
    with pytest.raises(EdgevlError, match="aspect ratio"):
        qwen_vl.smart_resize(10, 2500, 32, 4096, 131072)


def test_modes_and_paths(tmp_path):
    """RGBA/greyscale/palette inputs and files (EXIF orientation applied) like transformers."""
    cfg = PREPROCESSOR
    for mode in ("RGBA", "L", "P"):
        img = smooth_image(70, 90, 3, mode)
        np.testing.assert_array_equal(qwen_vl.preprocess(img, qwen_vl.ProcessorConfig.from_dict(cfg))["pixel_values"],
                                      _hf(cfg, img)[0])
    img = smooth_image(60, 100, 4)
    exif = Image.Exif()
    exif[0x0112] = 6   # rotate 90 degrees on display
    img.save(tmp_path / "r.jpg", exif=exif.tobytes())
    ours = qwen_vl.preprocess(tmp_path / "r.jpg", qwen_vl.ProcessorConfig.from_dict(cfg))
    assert ours["image_size"] == (60, 100)   # displayed upright: width and height swapped


def test_rope_index_and_tables_match_transformers(tmp_path):
    from transformers import Qwen3_5Config
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model, Qwen3_5TextRotaryEmbedding

    tc = dict(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
              head_dim=128, rope_parameters={"rope_type": "default", "rope_theta": 1e7, "mrope_section": [6, 5, 5],
                                             "mrope_interleaved": True, "partial_rotary_factor": 0.25})
    cfg = Qwen3_5Config(text_config=tc, vision_config=dict(depth=1, hidden_size=16, num_heads=1, out_hidden_size=32),
                        image_token_id=9)
    model = Qwen3_5Model(cfg)
    img = 9
    grids = [(1, 4, 6), (1, 10, 2), (1, 2, 2)]
    ids = [1, 2] + [img] * 6 + [3, 4, 5] + [img] * 5 + [8] + [img] * 1 + [6, 7]
    t = torch.tensor([ids])
    ref, delta = model.get_rope_index(t, (t == img).int(), torch.tensor(grids))
    ours = rope.rope_positions(ids, grids, img, 2)
    np.testing.assert_array_equal(ours, ref[:, 0].numpy())
    assert ours.max() + 1 - len(ids) == int(delta)
    # interleaved M-RoPE angles
    rot = Qwen3_5TextRotaryEmbedding(cfg.text_config)
    pos = torch.from_numpy(np.concatenate([ours, ours.max() + 1 + np.zeros((3, 1), np.int64)], 1))[:, None]
    cos, sin = rot(torch.zeros(1), pos)
    oc, os_ = rope.mrope_tables(pos[:, 0].numpy(), 32, 1e7, [6, 5, 5])
    np.testing.assert_allclose(oc, cos[0, :, :16].numpy(), atol=2e-6)
    np.testing.assert_allclose(os_, sin[0, :, :16].numpy(), atol=2e-6)
    np.testing.assert_array_equal(cos[0, :, :16].numpy(), cos[0, :, 16:].numpy())   # cat(f, f): half is enough


@pytest.mark.parametrize("grid", [(1, 4, 6), (1, 62, 2), (1, 20, 30)])
def test_vision_tables_match_transformers(grid):
    from transformers import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionRotaryEmbedding
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

    vc = Qwen3_5VisionConfig(hidden_size=48, num_heads=3, num_position_embeddings=64)
    g = torch.tensor([grid])
    pos_ids = get_vision_position_ids(g, 2)
    cos, sin = Qwen3_5VisionRotaryEmbedding(vc)(torch.zeros(1), pos_ids)
    oc, os_ = qwen_vision.vision_rope_tables(grid[1], grid[2], 16, vc.rope_parameters["rope_theta"], 2)
    np.testing.assert_allclose(oc, cos[:, :8].numpy(), atol=1e-6)
    np.testing.assert_allclose(os_, sin[:, :8].numpy(), atol=1e-6)
    table = torch.randn(64, 48, generator=torch.Generator().manual_seed(0))
    idx, w = get_vision_interpolation_indices_and_weights(g, 8, mode="bilinear", align_corners=True,
                                                          spatial_merge_size=2)
    ref = (torch.nn.functional.embedding(idx, table) * w[:, :, None]).sum(1)
    np.testing.assert_allclose(qwen_vision.vision_pos_embed(table.numpy(), grid[1], grid[2], 2), ref.numpy(), atol=1e-6)
