"""Encoded images are kept (``image_cache_mb``): the same pixels at the same patch limit run the
vision tower once, however they are passed (a PIL image, a file's bytes, its path), and give the
rows a model without the cache computes; the cache keeps within its budget, least recent out."""

import io

import numpy as np
import pytest
from PIL import Image

import edgevl
from edgevl.demo import demo_package
from edgevl.errors import EdgevlError
from edgevl.model import ImageCache


class Counting:
    """The model's vision tower, counting the images it encodes."""

    def __init__(self, vision):
        self.vision, self.calls = vision, 0

    def __call__(self, image, max_image_patches=None):
        self.calls += 1
        return self.vision(image, max_image_patches)

    def __getattr__(self, name):
        return getattr(self.vision, name)


def picture(seed: int, w: int = 96, h: int = 64) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def plain():
    """The demo model without the cache: every call encodes."""
    return edgevl.load(demo_package(), image_cache_mb=0)


def counted(**options):
    model = edgevl.load(demo_package(), **options)
    model.vision = Counting(model.vision)
    return model


def test_the_same_picture_is_encoded_once_however_it_is_passed(plain, tmp_path):
    model = counted()
    a = picture(1)
    path = tmp_path / "a.png"
    path.write_bytes(png(a))
    want, want_info = plain.encode_image(a)
    for given in (a, png(a), path, str(path), a.convert("RGBA")):   # alpha is dropped: the same pixels
        rows, info = model.encode_image(given)
        np.testing.assert_array_equal(rows, want)
        assert info == want_info
    assert model.vision.calls == 1 and (model.image_cache.hits, model.image_cache.misses) == (4, 1)

    rows, info = model.encode_image(a)
    with pytest.raises(ValueError):
        rows[0, 0] = 1.0            # shared with later requests: read-only
    info["grid"] = None             # each caller gets its own info
    assert model.encode_image(a)[1] == want_info

    b = picture(2)
    np.testing.assert_array_equal(model.encode_image(b)[0], plain.encode_image(b)[0])
    assert model.vision.calls == 2
    small = plain.encode_image(a, max_image_patches=16)[0]
    assert small.shape[0] < want.shape[0]
    np.testing.assert_array_equal(model.encode_image(a, max_image_patches=16)[0], small)
    assert model.vision.calls == 3      # another patch limit is another encoding


def test_a_bad_image_still_fails_in_one_line():
    model = counted()
    with pytest.raises(EdgevlError, match="Not a readable image file"):
        model.encode_image(b"not an image")
    assert model.vision.calls == 0 and model.image_cache.bytes == 0


def test_the_cache_keeps_within_its_budget_least_recent_first(plain):
    model = counted()
    a, b, c = picture(1), picture(2), picture(3)      # one size: rows of one size
    size = plain.encode_image(a)[0].nbytes
    model.image_cache = ImageCache(int(2.5 * size))
    for im in (a, b, a, c):      # c pushes out b, used less recently than a
        model.encode_image(im)
    assert model.vision.calls == 3 and model.image_cache.bytes == 2 * size
    model.encode_image(a)
    assert model.vision.calls == 3
    model.encode_image(b)
    assert model.vision.calls == 4 and model.image_cache.bytes <= 2.5 * size

    # an image larger than the whole budget is not kept, and pushes nothing out
    small = picture(5, 32, 32)
    model.image_cache = ImageCache(size - 1)
    model.encode_image(small)
    model.encode_image(a)
    model.encode_image(a)
    assert model.vision.calls == 7
    model.encode_image(small)
    assert model.vision.calls == 7 and model.image_cache.bytes == plain.encode_image(small)[0].nbytes


def test_image_cache_mb_zero_keeps_nothing_and_a_negative_budget_is_refused():
    model = counted(image_cache_mb=0)
    a = picture(1)
    model.encode_image(a)
    model.encode_image(a)
    assert model.vision.calls == 2
    with pytest.raises(EdgevlError, match="image_cache_mb must be >= 0"):
        edgevl.load(demo_package(), image_cache_mb=-1)


def test_a_second_question_about_an_image_answers_as_without_the_cache(plain):
    """Through generate, as a chat client sends it (the picture again in every request)."""
    model = counted()
    a = picture(4, 64, 48)
    questions = ("What shapes are there?", "What colour is the circle?")
    want = [edgevl.generate(plain, q, image=a, max_new_tokens=8) for q in questions]
    got = [edgevl.generate(model, q, image=png(a), max_new_tokens=8) for q in questions]
    assert got == want and model.vision.calls == 1


def test_a_video_file_sent_again_is_not_decoded_and_encoded_again(tmp_path):
    """A video file (by path, or the server's copy of a data: URL) is encoded once per sampling
    options; frames in memory are not kept. The answer is the uncached one."""
    from edgevl.processing.video import VideoFile
    from support.clips import save_animation, small_frames
    from support.qwen import make_qwen3_5

    pkg = edgevl.convert(make_qwen3_5(tmp_path / "ck", seed=4), tmp_path / "pkg", dtype="fp32", progress=False)
    clip = save_animation(tmp_path / "clip.gif", small_frames(4, 64, 64))
    plain, model = edgevl.load(pkg, image_cache_mb=0), edgevl.load(pkg)
    calls = []
    encode = model.vision.encode_video
    model.vision.encode_video = lambda *a, **k: calls.append(a) or encode(*a, **k)

    def ask(m, video, **options):
        return edgevl.generate(m, "What happens?", video=video, video_options=options or None, max_new_tokens=4,
                               thinking=False)

    want = ask(plain, clip)
    assert (plain.image_cache.hits, plain.image_cache.misses) == (0, 1)   # counted with the cache off too
    assert ask(model, clip) == ask(model, clip) == want and len(calls) == 1
    rows, info = model.encode_video(clip)
    assert len(calls) == 1 and info["seconds"] < 0.5
    with open(clip, "rb") as f:        # the server's form: an open file of the same bytes
        model.encode_video(VideoFile(file=f, name="the video"))
    assert len(calls) == 1
    ask(model, clip, fps=1)            # other sampling options: another encoding
    assert len(calls) == 2
    frames = small_frames(4, 64, 64)
    ask(model, frames)
    ask(model, frames)
    assert len(calls) == 4             # frames in memory: encoded each time
