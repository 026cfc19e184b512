"""The demo model's synthetic scenes (edgevl.demo.scenes): determinism, QA consistency, parsers."""

import random

import numpy as np
import pytest
from PIL import Image

from edgevl.demo import scenes as S

N = 60


@pytest.fixture(scope="module")
def scenes():
    return S.make_scenes(7, N)


def _pixels(scene):
    return np.asarray(scene.image)


def test_images_are_128_rgb(scenes):
    for sc in scenes:
        assert isinstance(sc.image, Image.Image)
        assert sc.image.mode == "RGB"
        assert sc.image.size == (S.IMAGE_SIZE, S.IMAGE_SIZE) == (128, 128)


def test_deterministic_per_seed():
    a, b = S.make_scenes(3, 10), S.make_scenes(3, 10)
    for x, y in zip(a, b):
        assert x.qa() == y.qa()
        assert np.array_equal(_pixels(x), _pixels(y))
    # make_scene with an int seed or an equally seeded Random gives the same scene
    assert S.make_scene(11).qa() == S.make_scene(random.Random(11)).qa()
    assert np.array_equal(_pixels(S.make_scene(11)), _pixels(S.make_scene(11)))
    # a prefix of a stream is the shorter stream
    assert [s.qa() for s in S.make_scenes(3, 4)] == [s.qa() for s in a[:4]]
    # and different seeds give different scenes
    assert [s.qa() for s in S.make_scenes(4, 10)] != [s.qa() for s in a]


def test_scene_metadata_is_valid(scenes):
    counts, shapes, colours, texts = set(), set(), set(), 0
    for sc in scenes:
        assert 1 <= sc.count <= 3 and sc.count == len(sc.shapes)
        assert sc.background in S.BACKGROUNDS
        assert len(sc.truth_pairs()) == sc.count  # (colour, shape) pairs are distinct
        centers = [s.center[0] for s in sc.shapes]
        assert centers == sorted(centers)  # left to right
        boxes = [s.bbox for s in sc.shapes] + ([sc.text_bbox] if sc.text else [])
        for i, a in enumerate(boxes):
            x1, y1, x2, y2 = a
            assert 0 <= x1 <= x2 < 128 and 0 <= y1 <= y2 < 128
            for b in boxes[i + 1:]:
                assert not S._overlaps(a, b, gap=1)  # non-overlapping, with a gap
        for s in sc.shapes:
            assert s.shape in S.SHAPES and s.colour in S.COLOURS and s.size in S.SIZES
            assert s.frame[2] == S.SIZES[s.size]
            for v in s.frame[:2]:  # on the patch grid, jittered
                assert abs((v - S.GRID_OFFSET + S.GRID // 2) % S.GRID - S.GRID // 2) <= S.POSITION_JITTER
        counts.add(sc.count)
        shapes |= {s.shape for s in sc.shapes}
        colours |= {s.colour for s in sc.shapes}
        texts += sc.text is not None
    assert counts == {1, 2, 3}
    assert shapes == set(S.SHAPES)
    assert colours == set(S.COLOURS)
    assert 0 < texts < N


def test_shapes_are_drawn_where_the_metadata_says(scenes):
    for sc in scenes:
        px = _pixels(sc).astype(int)
        bg = px[0, 0] if not any(s.bbox[0] == 0 and s.bbox[1] == 0 for s in sc.shapes) else None
        for s in sc.shapes:
            x1, y1, x2, y2 = s.bbox
            want = np.array(S.COLOURS[s.colour])
            patch = px[y1:y2 + 1, x1:x2 + 1].reshape(-1, 3)
            close = np.abs(patch - want).max(axis=1) <= S.COLOUR_JITTER
            # the shape's colour fills a good part of its box and touches all four edges
            assert close.mean() > 0.3, (s, close.mean())
            region = close.reshape(y2 - y1 + 1, x2 - x1 + 1)
            assert region[0].any() and region[-1].any() and region[:, 0].any() and region[:, -1].any()
            # and is nowhere outside its box
            outside = np.abs(px - want).max(axis=2) <= S.COLOUR_JITTER
            for t in sc.shapes:  # another shape may share the colour
                if t.colour == s.colour:
                    outside[t.bbox[1]:t.bbox[3] + 1, t.bbox[0]:t.bbox[2] + 1] = False
            assert not outside.any()
        if bg is not None:
            assert np.abs(bg - np.array(S.BACKGROUNDS[sc.background])).max() <= S.BACKGROUND_JITTER


def test_qa_answers_match_metadata(scenes):
    for sc in scenes:
        qa = dict(sc.qa())
        assert list(qa) == [q for q, _ in sc.qa()]  # no repeated question
        assert qa[S.COUNT_Q] == {1: "One.", 2: "Two.", 3: "Three."}[sc.count]
        assert qa[S.BACKGROUND_Q].lower() == sc.background + "."
        assert qa[S.TEXT_Q] == (f"{sc.text}." if sc.text else "Nothing.")
        desc = qa[S.DESCRIBE_Q]
        for s in sc.shapes:
            assert f"{s.size} {s.colour} {s.shape} {s.position}" in desc
        for s in sc.shapes:
            unique_shape = sum(t.shape == s.shape for t in sc.shapes) == 1
            unique_colour = sum(t.colour == s.colour for t in sc.shapes) == 1
            q = f"What color is the {s.shape}?"
            assert (q in qa) == unique_shape
            if unique_shape:
                assert qa[q] == s.colour.capitalize() + "."
                assert S.parse_box(qa[f"Where is the {s.shape}?"]) == s.bbox
            q = f"What is the {s.colour} shape?"
            assert (q in qa) == unique_colour
            if unique_colour:
                assert qa[q] == f"A {s.size} {s.shape}."


def test_box_answers_are_inside_the_shape_bbox(scenes):
    seen = 0
    for sc in scenes:
        by_name = {s.shape: s for s in sc.shapes}
        for q, a in sc.qa():
            if not q.startswith("Where is the "):
                continue
            assert a.startswith("<box><x_") and a.endswith("</box>")
            s = by_name[q[len("Where is the "):-1]]
            x1, y1, x2, y2 = S.parse_box(a)
            bx1, by1, bx2, by2 = s.bbox
            assert bx1 <= x1 <= x2 <= bx2 and by1 <= y1 <= y2 <= by2
            assert 0 <= x1 and x2 <= 127 and 0 <= y1 and y2 <= 127  # resized = original 128x128
            # the box is tight: the shape's mask reaches every edge
            mask = np.asarray(S.shape_mask(s)) > 0
            ys, xs = np.nonzero(mask)
            assert (xs.min(), ys.min(), xs.max(), ys.max()) == (x1, y1, x2, y2)
            seen += 1
    assert seen > N


def test_parsers_round_trip(scenes):
    for sc in scenes:
        qa = dict(sc.qa())
        assert S.parse_description(qa[S.DESCRIBE_Q]) == sc.truth_pairs()
        assert S.parse_count(qa[S.COUNT_Q]) == sc.count


def test_parsers_on_free_text():
    assert S.parse_description("A small red circle on the left and a large blue square.") == {
        ("red", "circle"), ("blue", "square")}
    assert S.parse_description("Red Circle, green stars") == {("red", "circle"), ("green", "star")}
    assert S.parse_description('A small red circle. The text "GREEN SQUARE" is written.') == {("red", "circle")}
    assert S.parse_description("A small red circle and a blue star") == {("red", "circle"), ("blue", "star")}
    assert S.parse_description("Nothing here.") == set()
    assert S.parse_count("Two.") == 2
    assert S.parse_count("There are three shapes.") == 3
    assert S.parse_count("3") == 3
    assert S.parse_count("I see none") is None
    assert S.parse_box("<box><x_1><y_2><x_30><y_40></box>") == (1, 2, 30, 40)
    assert S.parse_box("A circle.") is None


def test_position_words():
    assert S.position_words(10, 10) == "at the top left"
    assert S.position_words(64, 64) == "in the center"
    assert S.position_words(120, 64) == "on the right"
    assert S.position_words(64, 120) == "at the bottom"
