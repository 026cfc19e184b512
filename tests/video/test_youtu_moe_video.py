"""The Youtu MoE hybrid on a video prompt: video rows route with qb_beta's vision row (the second),
as the layout's source says image and video tokens do; text rows as text; the experts chosen per
row and the last logits equal the project's PyTorch reference fed the same input rows."""

import numpy as np
import pytest
import torch

import edgevl
from edgevl.generate import prepare
from edgevl.verification.families.youtu_moe import VERIFY as ARCH
from support.common import smooth_image
from support.moe import record_routes


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("youtu-moe-video")
    name = list(ARCH.tiny_variants)[0]
    ck = ARCH.make_tiny(root / name, name, seed=71)
    frames = [smooth_image(90 + 4 * 7, 50, 5).crop((4 * i, 0, 4 * i + 90, 50)) for i in range(7)]
    gif = root / "clip.gif"
    frames[0].save(gif, save_all=True, append_images=frames[1:], duration=140, loop=0)
    return ck, edgevl.convert(ck, root / "pk", dtype="fp32", progress=False), str(gif)


def test_video_rows_route_with_the_vision_row_of_qb_beta(built, monkeypatch):
    ck, pk, gif = built
    model = edgevl.load(pk)
    first_moe = min(int(x["layer"]) for x in model.manifest["experts"]["layers"])
    seen = record_routes(monkeypatch, first_moe)
    prep = prepare(model, "What happens in the video?", video=gif)
    ids = np.asarray(prep.input_ids)
    is_video = ids == model.video_token_id
    assert is_video.sum() >= 8 and not (ids == model.image_token_id).any()
    embeds = model.embed(prep.input_ids, prep.image_rows)
    positions = model.positions(prep.input_ids, prep.images)
    model.decoder.forward(embeds, model.decoder.new_cache(), positions, ids=prep.input_ids)
    model.decoder.forward(embeds, model.decoder.new_cache(), positions)   # no ids: every row as text
    as_video, as_text = seen
    changed = (as_video != as_text).any(axis=1)
    assert changed[is_video].any(), "video rows must use qb_beta's vision row"
    assert not changed[~is_video].any()

    # the reference, given the same input rows and positions: its router's choices and logits
    ref = ARCH.reference(ck).model
    chosen = []
    hook = ref.model.layers[first_moe].mlp.gate.register_forward_hook(
        lambda m, i, o: chosen.append(np.sort(o[2].numpy(), axis=1)))
    try:
        with torch.no_grad():
            h = ref.model(torch.from_numpy(embeds)[None].to(ref.dtype), torch.from_numpy(positions),
                          modality=ref.modality(prep.input_ids))
            logits = ref.lm_head(h)[0, -1].float().numpy()
    finally:
        hook.remove()
    assert np.array_equal(chosen[0], as_video)
    ours = np.asarray(model.prefill(prep.input_ids, prep.image_rows, reuse_cache=False, images=prep.images))
    assert ours.shape == logits.shape and int(ours.argmax()) == int(logits.argmax())
    np.testing.assert_allclose(ours, logits, rtol=1e-3, atol=1e-3)
