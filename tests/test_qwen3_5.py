"""Qwen3.5 on ncnn vs transformers' Qwen3_5ForConditionalGeneration (fp32, random tiny configs):
greedy tokens, per-layer hidden states, the conv and delta-rule states after prefill, and prefix
reuse by snapshot. input_ids come from transformers' own Qwen3VLProcessor."""

import numpy as np
import pytest
import torch
from PIL import Image

from edgevl.errors import EdgevlError
from edgevl.models import qwen3_5 as q
from helpers import CORPUS
from qwen_helpers import Runner, convert_package, cosine, hf_greedy, hf_inputs, hf_processor, load_hf, make_qwen3_5

CONFIGS = {
    # Hv = 2 Hk, tied, L L L F, attention head 64, GQA 2:1
    "hv2hk-tied-i4-hd64": dict(),
    # Hv = Hk, untied, L F L F, head 128, Dk = Dv, deeper vision
    "hvhk-untied-i2-hd128": dict(linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
                                 head_dim=128, num_attention_heads=4, num_key_value_heads=2,
                                 full_attention_interval=2, tie_word_embeddings=False,
                                 vision=dict(depth=3, hidden_size=48, num_heads=3, intermediate_size=80)),
    # head 256, L L F, Dk > Dv, no GQA, wider hidden
    "hd256-i3": dict(head_dim=256, num_hidden_layers=3, full_attention_interval=3, hidden_size=96,
                     intermediate_size=128, num_key_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=16,
                     linear_num_key_heads=1, linear_num_value_heads=2),
}
N_NEW = 48


def image(w, h, seed=0):
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
    return Image.fromarray(base).resize((w, h), Image.BICUBIC)  # smooth, so resizing matters


LONG = " ".join(CORPUS[:9])   # well over two 64-token chunks
PROMPTS = {
    "short": ([{"role": "user", "content": "Describe the image in one sentence."}], []),
    "long": ([{"role": "user", "content": LONG}], []),
    "image-37x1001": ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}],
                      [image(37, 1001, 1)]),
    "two-images": ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                                 {"type": "image"}, {"type": "text", "text": "compare them."}]}],
                   [image(64, 150, 2), image(200, 70, 3)]),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen")
    out = {}
    for i, (name, over) in enumerate(CONFIGS.items()):
        ck = make_qwen3_5(root / name, seed=40 + i, **over)
        out[name] = (ck, convert_package(ck, root / f"{name}-fp32"))
    return out


_loaded = {}


def _load(models, name):
    if name not in _loaded:
        ck, pk = models[name]
        _loaded[name] = (Runner(pk), load_hf(ck), hf_processor(ck))
    return _loaded[name]


def _first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


@pytest.mark.parametrize("prompt", list(PROMPTS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fp32_greedy_token_exact(models, name, prompt):
    ours_m, ref, proc = _load(models, name)
    msgs, images = PROMPTS[prompt]
    ids, enc = hf_inputs(proc, msgs, images)
    if prompt == "long":
        assert len(ids) > 2 * 64
    if images:
        assert sum(t == proc.image_token_id for t in ids) == sum(
            int(g.prod()) // 4 for g in enc["image_grid_thw"])
    ours = ours_m.greedy(ids, N_NEW, images)
    theirs = hf_greedy(ref, enc, N_NEW)
    assert len(ours) == len(theirs) == N_NEW
    first = _first_diff(ours, theirs)
    assert first is None, f"{name}/{prompt}: first differing token at {first}: ours {ours[first]} vs {theirs[first]}"


def _reference_prefill(ref, enc):
    outs = []
    hooks = [layer.register_forward_hook(lambda m, i, o: outs.append(o[0] if isinstance(o, tuple) else o))
             for layer in ref.model.language_model.layers]
    try:
        with torch.no_grad():
            r = ref(**enc, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    return [o[0].numpy() for o in outs], r.cache, r.logits[0, -1].numpy()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_layers_and_states_after_prefill(models, name):
    """Long prompt with an image: every layer's hidden state (cosine) and, per recurrent layer, the
    conv window and the delta-rule matrix against transformers' cache after prefill."""
    ours_m, ref, proc = _load(models, name)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": LONG}]}]
    images = [image(90, 60, 5)]
    ids, enc = hf_inputs(proc, msgs, images)
    names = ours_m.decoder.info["outputs"]["layers"]
    logits, cache, extras = ours_m.prefill(ids, images, extract=names)
    states, hf_cache, ref_logits = _reference_prefill(ref, enc)
    for i, (n, st) in enumerate(zip(names, states)):
        c = cosine(extras[n], st)
        assert c >= 0.99999, f"{name}: layer {i} cosine {c:.7f} (max diff {np.abs(extras[n] - st).max():.3g})"
    assert cosine(logits, ref_logits) >= 0.99999
    from edgevl.runtime import from_mat

    d = ours_m.decoder.core.d
    assert cache.recurrent, "no recurrent layers"
    for i in cache.recurrent:
        layer = hf_cache.layers[i]
        conv_ref = layer.conv_states[0][0, :, -(d.conv_kernel - 1):].numpy()   # the columns the conv reads
        mat_ref = layer.recurrent_states[0][0].numpy()
        conv, mat = from_mat(cache.conv[i]), from_mat(cache.matrix[i])
        assert conv.shape == conv_ref.shape and mat.shape == mat_ref.shape
        assert np.abs(conv - conv_ref).max() <= 1e-5 * max(1.0, np.abs(conv_ref).max()), f"layer {i} conv state"
        assert np.abs(mat - mat_ref).max() <= 1e-5 * max(1.0, np.abs(mat_ref).max()), f"layer {i} recurrent state"
    for i in cache.attention:   # K/V hold every prompt token
        assert all(m.h == len(ids) for m in cache.kv[i])


def test_prefix_reuse_by_snapshot(models):
    """Turn 1 (with an image) is prefilled up to the end of the user message, snapshotted, then
    answered. Turn 2 restores the snapshot and prefills only what follows it: same tokens as a
    fresh run over the whole second prompt."""
    ours_m, ref, proc = _load(models, "hv2hk-tied-i4-hd64")
    img = image(120, 80, 7)
    turn1 = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    ids1, _ = hf_inputs(proc, turn1, [img])
    boundary = len(ids1) - ids1[::-1].index(proc.tokenizer.convert_tokens_to_ids("<|im_start|>")) - 1
    # prefill the user turn, snapshot at the boundary, then the generation prompt
    rows, infos = ours_m.encode_images([img])
    pos = ours_m.positions(ids1, infos)
    x = ours_m.embed(ids1, rows)
    cache = ours_m.decoder.new_cache()
    ours_m.decoder.forward(x[:boundary], cache, pos[:, :boundary])
    snap = cache.snapshot()
    assert snap.length == boundary and snap.bytes() > 0
    hidden, _ = ours_m.decoder.forward(x[boundary:], cache, pos[:, boundary:])
    answer = [int(np.argmax(ours_m.head(hidden[-1:])[0]))]
    for _ in range(11):
        answer.append(int(np.argmax(ours_m.step(answer[-1], cache))))
    turn2 = turn1 + [{"role": "assistant", "content": proc.tokenizer.decode(answer, skip_special_tokens=True)},
                     {"role": "user", "content": "And the colors?"}]
    ids2, enc2 = hf_inputs(proc, turn2, [img])
    assert ids2[:boundary] == ids1[:boundary]
    cache.restore(snap)
    assert cache.length == boundary and all(m.h == boundary for i in cache.attention for m in cache.kv[i])
    reused = ours_m.greedy(ids2, 24, [img], cache=cache, start=boundary)
    fresh = ours_m.greedy(ids2, 24, [img])
    assert reused == fresh, f"first differing token at {_first_diff(reused, fresh)}"
    assert fresh == hf_greedy(ref, enc2, 24)


def test_light_mode_off_gives_the_same_tokens(models):
    """The driver extracts each recurrent layer's blobs before their consumers run (light mode
    frees consumed blobs); with light mode off nothing is freed: same tokens either way."""
    ck, pk = models["hvhk-untied-i2-hd128"]
    msgs, images = PROMPTS["two-images"]
    ids, _ = hf_inputs(_load(models, "hvhk-untied-i2-hd128")[2], msgs, images)
    assert Runner(pk, light_mode=False).greedy(ids, 16, images) == _load(models, "hvhk-untied-i2-hd128")[0].greedy(
        ids, 16, images)


def test_image_patch_budget(models):
    ours_m, _, _ = _load(models, "hv2hk-tied-i4-hd64")
    img = image(640, 480, 9)
    rows, info = ours_m.vision(img)
    small, sinfo = ours_m.vision(img, max_image_patches=64)
    _, gh, gw = sinfo["grid_thw"]
    assert gh * gw <= 64 < info["grid_thw"][1] * info["grid_thw"][2]
    assert small.shape == (gh * gw // 4, rows.shape[1])
    with pytest.raises(EdgevlError, match="max_image_patches must be at least 4"):
        ours_m.vision(img, max_image_patches=2)


def test_cache_rules(models):
    ours_m, _, _ = _load(models, "hv2hk-tied-i4-hd64")
    ids = list(range(20, 40))
    _, cache, _ = ours_m.prefill(ids)
    snap = cache.snapshot()
    with pytest.raises(EdgevlError, match="cannot be truncated"):
        cache.truncate(5)
    cache.truncate(len(ids))            # a no-op
    assert cache.length == len(ids)
    cache.truncate(0)
    assert cache.length == 0 and all(v is None for v in cache.kv.values())
    with pytest.raises(EdgevlError, match="another conversation"):
        cache.restore(snap)


def test_conversion_notes_mtp_and_refuses_bad_configs(models, tmp_path):
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    from edgevl.weights import Checkpoint

    ck, _ = models["hd256-i3"]
    bad = tmp_path / "ck"
    shutil.copytree(ck, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["mtp.fc.weight"] = np.zeros((4, 4), np.float32)
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "pk").mkdir()
    parts = q.convert(Checkpoint(bad), tmp_path / "pk", "fp32", lambda t: None)
    assert parts["mtp"]["tensors"] == 1 and "mtp.fc.weight" not in json.dumps(parts["graphs"])
    cfg = json.loads((bad / "config.json").read_text())
    for change, msg in ((lambda c: c["text_config"].update(layer_types=["linear_attention"] * 2), "layer_types"),
                        (lambda c: c["text_config"]["rope_parameters"].update(mrope_section=[8, 8, 8]), "mrope_section"),
                        (lambda c: c["text_config"].update(linear_num_key_heads=2, linear_num_value_heads=3), "multiple of key heads"),
                        (lambda c: c.pop("text_config"), "needs a text_config")):
        c = json.loads(json.dumps(cfg))
        change(c)
        with pytest.raises(EdgevlError, match=msg):
            q.TextArgs.from_config(c)


def test_positions_errors():
    with pytest.raises(EdgevlError, match="image tokens but the image gives"):
        q.rope_positions([1, 5, 5, 5, 2], [(1, 4, 4)], 5, 2)
    with pytest.raises(EdgevlError, match="more image-token runs"):
        q.rope_positions([1, 5, 5, 5, 5, 2], [], 5, 2)
    with pytest.raises(EdgevlError, match="2 images were given"):
        q.rope_positions([1, 5, 5, 5, 5, 2], [(1, 4, 4), (1, 4, 4)], 5, 2)
