"""Boxes in original-image pixels, for every image: the model's coordinates times the resize
factors, clamped to the image, each box on the image the answer names, and the structured boxes
in --draw-boxes and the server's replies (the demo model)."""

import base64
import http.client
import io
import json
import re

import numpy as np
import pytest
from PIL import Image

import edgevl
from edgevl import cli
from edgevl.boxes import Box
from edgevl.demo import demo_package
from edgevl.demo import scenes as S
from edgevl.engine import Engine
from edgevl.model import Model
from edgevl.models.youtu_vl.processing import target_size
from edgevl.server import make_server


@pytest.fixture(scope="module")
def demo():
    return edgevl.load(demo_package())


def force(monkeypatch, model, text):
    """Make the model 'generate' exactly the tokens of ``text`` (then end of text)."""
    ids = model.tokenizer.encode(text) + [min(model.eos_ids)]

    def fake(self, input_ids, max_new_tokens=256, image=None, **kw):
        self.encode_images(image)  # the images are still processed as usual
        yield from ids

    monkeypatch.setattr(Model, "generate_tokens", fake)
    # the server's requests go through its engine
    monkeypatch.setattr(Engine, "generate_tokens", lambda self, *a, **k: fake(self.model, *a, **k))
    return ids


def scene(w, h, seed=3):
    return S.make_scene(seed).image.resize((w, h), Image.BICUBIC)


def resize_factors(w, h, model):
    """(x, y) original / resized, from the processor's size search (not from generation)."""
    rh, rw = target_size(h, w, model.vision.default_max_patches, 16, 2)
    return w / rw, h / rh


@pytest.mark.parametrize("size", [(640, 640), (100, 300)], ids=["640x640", "100x300"])
def test_boxes_are_the_models_coordinates_times_the_resize_factors(demo, monkeypatch, size):
    w, h = size
    coords = (84, 86, 123, 121) if w == 640 else (10, 20, 60, 180)  # in the resized image the model sees
    force(monkeypatch, demo, "<ref>triangle</ref><box><x_{}><y_{}><x_{}><y_{}></box>".format(*coords))
    done = edgevl.complete(demo, "Where is the triangle?", image=scene(w, h))
    fx, fy = resize_factors(w, h, demo)
    want = [round(coords[0] * fx), round(coords[1] * fy), round(coords[2] * fx), round(coords[3] * fy)]
    assert done.boxes == [Box("triangle", *want, 0)]
    assert all(0 <= x < w for x in want[::2]) and all(0 <= y < h for y in want[1::2])
    assert max(want) > 127  # beyond the demo's largest coordinate token: numbers, not tokens
    assert done.text == "<ref>triangle</ref><box><x_{}><y_{}><x_{}><y_{}></box>".format(*want)
    # the model's own coordinates stay available
    raw = edgevl.generate(demo, "Where is the triangle?", image=scene(w, h), postprocess=False)
    assert raw == "<ref>triangle</ref><box><x_{}><y_{}><x_{}><y_{}></box>".format(*coords)


def test_coordinates_past_the_resized_image_clamp_to_the_original():
    from edgevl.models.youtu_vl.runtime import GroundingProcessor

    p = GroundingProcessor([{"image_size": (300, 100), "resized_size": (192, 64)}])
    assert p.feed("<box><x_0><y_0><x_2047><y_2047></box>") == "<box><x_0><y_0><x_99><y_299></box>"


def test_real_generation_on_an_upscaled_scene_gives_boxes_in_its_pixels(demo):
    """An image larger than the model's coordinates, generated for real: a 128x128 demo scene scaled
    to 640x640."""
    im = scene(640, 640, seed=5)
    raw = edgevl.generate(demo, "Where is the circle?", image=im, max_new_tokens=16, postprocess=False)
    coords = [int(v) for v in re.findall(r"<[xy]_(\d+)>", raw)]
    assert len(coords) == 4, raw
    done = edgevl.complete(demo, "Where is the circle?", image=im, max_new_tokens=16)
    assert len(done.boxes) == 1 and done.boxes[0].xyxy == tuple(min(round(c * 5), 639) for c in coords)


def test_each_box_goes_to_the_image_the_answer_names_else_the_last(demo, monkeypatch):
    big, tall = scene(640, 640), scene(100, 300, seed=4)
    (bx, by), (tx, ty) = resize_factors(640, 640, demo), resize_factors(100, 300, demo)
    force(monkeypatch, demo, "Image 1: <box><x_84><y_86><x_123><y_121></box> image 2: "
                             "<box><x_10><y_20><x_60><y_180></box>")
    done = edgevl.complete(demo, "Where are the shapes?", image=[big, tall])
    assert done.boxes == [Box(None, round(84 * bx), round(86 * by), round(123 * bx), round(121 * by), 0),
                          Box(None, round(10 * tx), round(20 * ty), round(60 * tx), round(180 * ty), 1)]
    force(monkeypatch, demo, "<box><x_10><y_20><x_60><y_180></box>")   # no mention: the last image,
    done = edgevl.complete(demo, "Where is it?", image=[big, tall])    # as the reference's img_input
    assert [b.image for b in done.boxes] == [1] and done.boxes[0].y2 == round(180 * ty)


def test_draw_boxes_and_the_server_use_the_structured_boxes(demo, monkeypatch, tmp_path, capsys):
    force(monkeypatch, demo, "<box><x_84><y_86><x_123><y_121></box>")
    scene(640, 640).save(tmp_path / "big.png")
    code = cli.main(["run", str(demo.path), "--image", str(tmp_path / "big.png"), "--prompt", "Where?",
                     "--draw-boxes", str(tmp_path / "boxes.png")])
    assert code == 0
    out = capsys.readouterr()
    assert out.out.strip() == "<box><x_420><y_430><x_615><y_605></box>" and "1 box(es) drawn" in out.err
    drawn = np.asarray(Image.open(tmp_path / "boxes.png").convert("RGB")).astype(int)
    plain = np.asarray(Image.open(tmp_path / "big.png").convert("RGB")).astype(int)
    changed = np.abs(drawn - plain).sum(-1) > 60
    assert changed[500, 418:423].any() and changed[500, 613:618].any()  # the left and right edges
    assert not changed[200:400, 130:400].any()  # nothing where the old clamped box (<= 127 .. 135) was

    buf = io.BytesIO()
    scene(640, 640).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    srv, _ = make_server(demo)
    try:
        for stream in (False, True):
            conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=30)
            conn.request("POST", "/v1/chat/completions", json.dumps({"stream": stream, "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "Where?"}]}]}),
                         {"Content-Type": "application/json"})
            body = conn.getresponse().read().decode()
            if stream:
                chunks = [json.loads(line[6:]) for line in body.split("\n") if line.startswith("data: {")]
                boxes = chunks[-1]["choices"][0]["delta"]["boxes"]
                assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
            else:
                msg = json.loads(body)["choices"][0]["message"]
                boxes = msg["boxes"]
                assert msg["content"] == "<box><x_420><y_430><x_615><y_605></box>"
            assert boxes == [{"label": None, "box": [420, 430, 615, 605], "image": 0}]
    finally:
        srv.stop()
