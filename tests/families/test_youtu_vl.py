"""Youtu-VL on ncnn vs the PyTorch reference (fp32, two random configs) at several image sizes and
patch budgets: greedy tokens, every stage's cosine, text-only and two-image prompts, bad images,
grounding boxes, the vision window layout, low-memory mode and the window attention's memory."""

import numpy as np
import pytest
import torch
from PIL import Image

import edgevl
from edgevl.errors import EdgevlError
from edgevl.generate import prepare
from edgevl.models.youtu_vl.runtime import GroundingProcessor, parse_boxes
from edgevl.verification.families.youtu_vl import torch_pixel_values
from edgevl.verification.references.youtu_vl import YoutuVLForConditionalGeneration
from edgevl.verification.verify import compare
from support.common import smooth_image
from support.youtu_vl import make_vl

CONFIGS = {
    # real window size (256 px): several windows only for large images
    "default": dict(),
    # full attention where the default pattern has window layers, small windows, odd text sizes
    "custom_full": dict(hidden_size=40, num_attention_heads=5, num_key_value_heads=5, qk_nope_head_dim=6, v_head_dim=10,
                        q_lora_rank=None,
                        vision_config={"fullatt_block_indexes": [0], "num_hidden_layers": 3,
                                       "window_size": 64, "hidden_size": 48, "num_attention_heads": 3}),
}


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl")
    out = {}
    for i, (name, over) in enumerate(CONFIGS.items()):
        ck, cfg = make_vl(root / name, seed=20 + i, **over)
        edgevl.convert(ck, root / f"{name}-pk", dtype="fp32", progress=False)
        ref = YoutuVLForConditionalGeneration.from_pretrained(ck).eval()
        out[name] = (ck, root / f"{name}-pk", ref, cfg)
    return out


SIZES = [((37, 1001), None), ((100, 50), None), ((640, 480), None), ((640, 480), 256)]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("size,budget", SIZES, ids=["37x1001", "100x50", "640x480", "640x480-budget256"])
def test_image_parity(vl, name, size, budget):
    ck, pk, ref, cfg = vl[name]
    model = edgevl.load(pk)
    img = smooth_image(*size, seed=size[0])
    prep = prepare(model, "Describe the image.", image=img, max_image_patches=budget)
    rows, info = model.vision(img, budget, extract_layers=True)
    gh, gw = info["spatial_shapes"]
    if budget:
        assert gh * gw <= budget and info["resized_size"] != (480, 480)
    # processor: bit-exact with torch's uint8 antialiased interpolate path
    v = model.vision.v
    tp = torch_pixel_values(img, budget or 36864, v.patch_size, v.spatial_merge_size)
    np.testing.assert_array_equal(info["pixel_values"], tp)
    # vision tower and merger
    pv = torch.from_numpy(info["pixel_values"])
    with torch.no_grad():
        merged, states = ref.vision_features(pv, (gh, gw), output_hidden_states=True)
    for i, ours in enumerate(info["layers"]):
        c = np.dot(ours.ravel(), states[i + 1].numpy().ravel()) / (
            np.linalg.norm(ours) * np.linalg.norm(states[i + 1].numpy()))
        assert c >= 0.99999, f"vision layer {i}: cosine {c}"
    np.testing.assert_allclose(rows, merged.numpy(), atol=1e-4, rtol=1e-3)
    assert rows.shape[0] == info["num_image_tokens"] == sum(t == cfg["image_token_id"] for t in prep.input_ids)
    # fp32 greedy: token-exact for 32 new tokens
    ours = list(model.generate_tokens(prep.input_ids, 32, image=prep.image_rows, ignore_eos=True))
    with torch.no_grad():
        theirs = list(ref.greedy_generate(torch.tensor([prep.input_ids]), pv, (gh, gw), max_new_tokens=32))
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    assert first is None, f"first differing token at {first}: {ours[first]} vs {theirs[first]}"


def test_verify_report_covers_every_stage(vl, tmp_path):
    ck, pk, _, _ = vl["custom_full"]
    img = smooth_image(200, 120, seed=1)
    img.save(tmp_path / "x.png")
    rep = compare(pk, ck, "What is this?", image=tmp_path / "x.png", max_new_tokens=8)
    assert rep.processor_max_diff == 0
    sections = [r[1] for r in rep.rows]
    assert sections[:3] == ["layer 0", "layer 1", "layer 2"] and "merger" in sections and "logits" in sections
    assert rep.min_cosine("vision") >= 0.99999 and rep.min_cosine("text") >= 0.99999
    assert rep.ok


def test_text_only_prompt_on_vl_model(vl):
    ck, pk, ref, _ = vl["default"]
    model = edgevl.load(pk)
    prep = prepare(model, "Just text, no picture.")
    assert prep.images == []
    ours = list(model.generate_tokens(prep.input_ids, 16, ignore_eos=True))
    with torch.no_grad():
        theirs = list(ref.greedy_generate(torch.tensor([prep.input_ids]), max_new_tokens=16))
    assert ours == theirs


def test_two_images_in_one_prompt(vl):
    ck, pk, ref, cfg = vl["custom_full"]
    model = edgevl.load(pk)
    a, b = smooth_image(64, 96, 1), smooth_image(160, 64, 2)
    msgs = [{"role": "user", "content": [{"type": "image", "image": a}, {"type": "text", "text": "and"},
                                          {"type": "image", "image": b}, {"type": "text", "text": "compare"}]}]
    prep = prepare(model, msgs)
    assert len(prep.image_rows) == 2
    logits = model.prefill(prep.input_ids, prep.image_rows, reuse_cache=False, images=prep.images)
    # reference: fuse both images' merger rows in order, then run the LM
    ids = torch.tensor([prep.input_ids])
    with torch.no_grad():
        rows = []
        for im in (a, b):
            pre = model.vision.preprocess(im)
            rows.append(ref.vision_features(torch.from_numpy(pre["pixel_values"]), pre["spatial_shapes"]))
        emb = ref.model.embed_tokens(ids)
        emb[ids == cfg["image_token_id"]] = torch.cat(rows)
        h = ref.model(inputs_embeds=emb).last_hidden_state
        ref_logits = ref.lm_head(h)[0, -1].numpy()
    np.testing.assert_allclose(logits, ref_logits, atol=1e-4, rtol=1e-3)
    with pytest.raises(EdgevlError, match="2 image parts but 1 images"):
        prepare(model, [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}], image=a)


def test_image_token_count_must_match(vl):
    _, pk, _, cfg = vl["default"]
    model = edgevl.load(pk)
    img = smooth_image(64, 64)
    prep = prepare(model, "hi", image=img)
    short = list(prep.input_ids)
    short.remove(cfg["image_token_id"])
    with pytest.raises(EdgevlError, match="image tokens but the image"):
        list(model.generate_tokens(short, 2, image=prep.image_rows))
    with pytest.raises(EdgevlError, match="image tokens but the image"):
        list(model.generate_tokens(prep.input_ids, 2))  # image tokens without an image


@pytest.mark.parametrize("setup,msg", [
    (lambda p: p.write_bytes(b""), "(?i)empty"),
    (lambda p: p.write_bytes(b"not an image at all"), "(?i)not a readable image"),
    (lambda p: None, "(?i)does not exist|no such file|not found"),
])
def test_bad_image_files(vl, tmp_path, setup, msg):
    _, pk, _, _ = vl["default"]
    model = edgevl.load(pk)
    p = tmp_path / "img.jpg"
    setup(p)
    with pytest.raises(EdgevlError, match=msg):
        edgevl.generate(model, "hi", image=p)


def test_truncated_jpeg_small_and_huge_images(vl, tmp_path):
    _, pk, _, _ = vl["default"]
    model = edgevl.load(pk)
    smooth_image(300, 200).save(tmp_path / "full.jpg", quality=90)
    data = (tmp_path / "full.jpg").read_bytes()
    (tmp_path / "cut.jpg").write_bytes(data[: len(data) // 2])
    with pytest.raises(EdgevlError, match="truncated"):
        edgevl.generate(model, "hi", image=tmp_path / "cut.jpg")
    # under 32 px: stretched to 32x32 (one merged token)
    prep = prepare(model, "hi", image=Image.new("RGB", (10, 5), "red"))
    assert prep.images[0]["resized_size"] == (32, 32) and prep.image_rows[0].shape[0] == 1
    # huge: downscaled by the patch budget
    huge = Image.new("RGB", (12000, 9000), "blue")
    prep = prepare(model, "hi", image=huge, max_image_patches=1024)
    gh, gw = prep.images[0]["spatial_shapes"]
    assert gh * gw <= 1024


def test_coordinates_are_rescaled_and_boxes_drawn(vl, tmp_path):
    from edgevl.boxes import Box, draw_boxes

    # original 100 wide x 50 high, resized 128 x 64: x * 100/128, y * 50/64
    p = GroundingProcessor([{"image_size": (50, 100), "resized_size": (64, 128)}])
    text = p.feed("a <ref>dog</ref><box><x_10><y_1") + p.feed("0><x_127><y_63></box> then <x_") + p.feed("5")
    assert text == "a <ref>dog</ref><box><x_8><y_8><x_99><y_49></box> then "   # 7.8 -> 8; clamped to 99/49
    assert p.feed(">.") == "<x_4>." and p.feed(" <y_") == " " and p.flush() == "<y_"  # 3.9 -> 4; cut off: as is
    assert p.boxes() == [Box("dog", 8, 8, 99, 49, 0)]
    boxes = parse_boxes("a <ref>dog</ref><box><x_4><y_5><x_20><y_30></box> and <box><x_9><y_9><x_1><y_2></box>")
    assert boxes == [Box("dog", 4, 5, 20, 30, 0), Box("dog", 1, 2, 9, 9, 0)]  # the last label before it
    im = draw_boxes(Image.new("RGB", (64, 64), "white"), boxes)
    assert im.getpixel((4, 15)) != (255, 255, 255) and im.getpixel((40, 50)) == (255, 255, 255)


@pytest.mark.parametrize("grid,classes", [((48, 64), 1), ((30, 64), 2), ((48, 40), 2), ((30, 40), 4), ((6, 10), 1)])
def test_window_layout_packs_real_patches_only(grid, classes):
    """Windows grouped by size into slots, no padding: every row is a real patch, each window's
    rows are contiguous and hold exactly that window's patches."""
    from edgevl.models.youtu_vl import processing as siglip2
    from edgevl.models.youtu_vl.config import WINDOW_SLOTS, VisionArgs
    from edgevl.models.youtu_vl.runtime import window_layout

    v = VisionArgs()  # real geometry: 256-px windows = 16 x 16 patches
    gh, gw = grid
    lay = window_layout(gh, gw, v)
    assert lay.rows == gh * gw and sorted(lay.position) == list(range(gh * gw))
    assert len(lay.slots) == classes <= WINDOW_SLOTS
    assert sum(n * s for n, s, _ in lay.slots) == gh * gw
    assert [start for _, _, start in lay.slots] == list(np.cumsum([0] + [n * s for n, s, _ in lay.slots])[:-1])
    window_index, cu = siglip2.window_partition(gh, gw, v.window_size, v.patch_size, v.spatial_merge_size)
    for w in range(len(cu) - 1):
        groups = window_index[cu[w] // 4:cu[w + 1] // 4]
        rows = np.sort(lay.position[(groups[:, None] * 4 + np.arange(4)).ravel()])
        assert rows[-1] - rows[0] == len(rows) - 1, f"window {w} is not contiguous"
        n, s, start = next(x for x in lay.slots if x[1] == len(rows))
        assert start <= rows[0] and rows[-1] < start + n * s and (rows[0] - start) % s == 0


def test_vision_graph_feeds_real_rows_only(vl):
    """640x480 on the real window size: 1200 patches fed as 1200 rows (the padded layout took
    1536); unused slots stand in as one-row windows of the last row."""
    _, pk, _, _ = vl["default"]
    enc = edgevl.load(pk).vision
    feeds, lay = enc.inputs(enc.preprocess(smooth_image(640, 480)))
    names = enc.info["inputs"]
    assert feeds[names["pixel_values"]].shape[0] == lay.rows == 1200
    shapes = [feeds[n].shape for n in names["window_shapes"]]
    assert len(lay.slots) == 4 and sum(n * s for n, s in shapes) == 1200  # 640x480: four window sizes
    assert [feeds[n].shape[0] - 1 for n in names["window_starts"]] == [start for _, _, start in lay.slots]
    feeds, lay = enc.inputs(enc.preprocess(smooth_image(512, 512)))  # one window size: three stand-in slots
    assert len(lay.slots) == 1 and [feeds[n].shape for n in names["window_shapes"]][1:] == [(1, 1)] * 3
    assert [feeds[n].shape[0] - 1 for n in names["window_starts"]][1:] == [lay.rows - 1] * 3


def test_package_with_the_padded_window_layout_is_refused(vl, tmp_path):
    """Packages converted before the packed window layout fed a key-bias input instead."""
    import json
    import shutil

    _, pk, _, _ = vl["custom_full"]
    old = tmp_path / "old"
    shutil.copytree(pk, old)
    m = json.loads((old / "manifest.json").read_text())
    inputs = m["graphs"]["vision"]["inputs"]
    for k in ("window_shapes", "window_starts"):
        del inputs[k]
    inputs["kbias"] = "kbias"
    m.pop("manifest_sha256")   # an old package: written before the manifest's own digest
    (old / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EdgevlError, match="older window layout; convert the model again"):
        edgevl.load(old)


def test_low_memory_mode_matches_resident(vl):
    _, pk, _, _ = vl["custom_full"]
    img = smooth_image(120, 90, seed=4)
    res = edgevl.generate(edgevl.load(pk), "Describe.", image=img, max_new_tokens=10)
    low = edgevl.load(pk, low_memory=True)
    assert type(low.vision.net).__name__ == "SectionedNet"
    assert edgevl.generate(low, "Describe.", image=img, max_new_tokens=10) == res


def test_vision_window_memory_is_linear_in_patches(tmp_path):
    """Window layers at 16384 patches (2048x2048): a dense N x N mask alone would be 1 GiB.

    The model has window layers only: whether full-attention layers hold N x N scores depends on
    ncnn's SDPA kernel (docs/ncnn.md, section 6), which is not ours to test.
    """
    from support.common import child_peak_kb

    ck, _ = make_vl(tmp_path / "win", seed=31, vision_config={"fullatt_block_indexes": []})
    pk = tmp_path / "win-pk"
    edgevl.convert(ck, pk, dtype="fp32", progress=False)
    peaks = {}
    for side, grid in ((1024, 64), (2048, 128)):
        smooth_image(side, side, seed=9).save(tmp_path / f"{side}.png")
        image = str(tmp_path / f"{side}.png")
        peaks[side] = child_peak_kb(
            f"import edgevl; m = edgevl.load({str(pk)!r}); "
            f"rows, info = m.vision({image!r}); assert info['spatial_shapes'] == ({grid}, {grid}), info; "
            "print(peak())") / 1024
    print(f"vision peak RSS: 4096 patches {peaks[1024]:.0f} MB, 16384 patches {peaks[2048]:.0f} MB")
    assert peaks[2048] < 600, f"peak RSS {peaks[2048]:.0f} MB for 16384 patches"
    # 4x the patches: linear growth adds at most ~4x the increment; quadratic would add 16x
    assert peaks[2048] - peaks[1024] < 400, peaks
