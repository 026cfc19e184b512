"""The int8 vision tower (``convert --vision q8``; the default of q8 packages): the merger's output
against the fp32 tower on random towers of both tower families at a width where int8 rows are not
trivially short (256), and on the trained demo model's tower; the option's values and its record
in the manifest. The demo model's answers with an int8 tower (every skill, parity with PyTorch)
were measured with ``edgevl.verification.demo_evaluate`` (docs/benchmarks.md)."""

import numpy as np
import pytest

import edgevl
from edgevl.demo import DEMO_CHECKPOINT
from edgevl.errors import EdgevlError
from support.common import smooth_image
from support.qwen import make_qwen3_5
from support.youtu_vl import make_vl

# Bound: the lowest merger row's cosine to fp32. Measured (AVX-512 VNNI; seeds 0-2 x 4 image sizes):
# Qwen3.5 width 256 >= 0.9993, its real 0.8B tower (12 x 768, random) 0.9996; Youtu-VL width 256
# >= 0.9991; the demo tower 0.9994 (bf16 towers: >= 0.9999). Bound 0.99: the acceptance bar, with
# room for other CPUs (int8 products sum exactly in int32 everywhere; the float work around them differs).
MIN_COSINE = 0.99
IMAGES = [smooth_image(97, 61, 1), smooth_image(200, 150, 2), smooth_image(64, 64, 3)]


def row_cosines(a, b):
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def towers(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision-int8")
    qwen = make_qwen3_5(root / "qwen", seed=5, vision=dict(depth=3, hidden_size=256, intermediate_size=1024,
                                                             num_heads=4, in_channels=3, patch_size=16,
                                                             spatial_merge_size=2, temporal_patch_size=2,
                                                             num_position_embeddings=256,
                                                             hidden_act="gelu_pytorch_tanh"))
    vl, _ = make_vl(root / "vl", seed=6, vision_config=dict(hidden_size=256, intermediate_size=1024,
                                                           num_attention_heads=4))
    out = {}
    for name, ck in (("qwen3_5", qwen), ("youtu_vl", vl), ("demo", DEMO_CHECKPOINT)):
        out[name] = {kind: edgevl.convert(ck, root / f"{name}-{kind}", dtype=dtype, progress=False, **opts)
                     for kind, dtype, opts in (("fp32", "fp32", {}), ("q8", "q8", {}),
                                               ("q8-float", "q8", {"vision": "float"}))}
    return out


@pytest.mark.parametrize("name", ["qwen3_5", "youtu_vl", "demo"])
def test_int8_tower_stays_close_to_fp32(towers, name):
    ref, q8, float_tower = (edgevl.load(towers[name][k]) for k in ("fp32", "q8", "q8-float"))
    assert q8.manifest["graphs"]["vision"]["extra"]["quantized"] is True
    assert float_tower.manifest["graphs"]["vision"]["extra"]["quantized"] is False
    assert q8.manifest["options"]["vision"] == "auto" and float_tower.manifest["options"]["vision"] == "float"
    assert "18=2" in (towers[name]["q8"] / "vision.param").read_text()        # int8 Gemms in the graph
    assert "18=2" not in (towers[name]["q8-float"] / "vision.param").read_text()
    for img in IMAGES:
        want = ref.encode_image(img)[0]
        got = q8.encode_image(img)[0]
        near = float_tower.encode_image(img)[0]
        assert want.shape == got.shape
        cos = row_cosines(got, want)
        assert cos.min() >= MIN_COSINE, (name, img.size, cos.min())
        assert not np.array_equal(got, near)       # the int8 tower is a different computation
        assert row_cosines(near, want).min() > cos.min() - 1e-3   # and not a better one than bf16


def test_option_values(towers, tmp_path):
    with pytest.raises(EdgevlError, match="vision must be one of auto, q8, float"):
        edgevl.convert(DEMO_CHECKPOINT, tmp_path / "x", dtype="q8", vision="int4", progress=False)
    pk = edgevl.convert(DEMO_CHECKPOINT, tmp_path / "bf16-q8", dtype="bf16", vision="q8", progress=False)
    assert edgevl.load(pk).manifest["graphs"]["vision"]["extra"]["quantized"] is True
