"""What the demo model is trained on (edgevl.verification.demo_train): per-cell labels of the
shapes, training rows and their targets, the description phrases' pointers, and the coordinate
targets spread over neighbouring coordinates."""

import math
import random

import numpy as np

from edgevl.demo import DEMO_CHECKPOINT
from edgevl.demo import scenes as S
from edgevl.verification import demo_train as T


def test_cell_labels_follow_the_shapes():
    seen_word = 0
    for scene in S.make_scenes(77, 20):
        lab = T.cell_labels(scene)
        shape_lab, colour_lab, centre = lab["shape"], lab["colour"], lab["centre"]
        assert sum(centre) == scene.count
        assert len(shape_lab) == len(colour_lab) == len(lab["word"]) == len(lab["box"]) == (S.IMAGE_SIZE // T.CELL) ** 2
        cover = {s.shape + s.colour: (np.asarray(S.shape_mask(s)) > 0).reshape(4, 32, 4, 32).sum(axis=(1, 3))
                 .reshape(-1) for s in scene.shapes}
        for s in scene.shapes:
            cells = cover[s.shape + s.colour]
            for i in np.nonzero(cells >= T.AUX_MIN_PIXELS)[0]:
                if all(cells[i] > c[i] for k, c in cover.items() if k != s.shape + s.colour):
                    # the shape covering most of a cell names it, and gives its box
                    assert T.AUX_SHAPES[shape_lab[i]] == s.shape
                    assert T.AUX_COLOURS[colour_lab[i]] == s.colour
                    assert lab["box_on"][i] == 1 and tuple(lab["box"][i]) == s.bbox
        covered = np.zeros(16, bool)
        for s in scene.shapes:
            covered |= (np.asarray(S.shape_mask(s)) > 0).reshape(4, 32, 4, 32).any(axis=(1, 3)).reshape(-1)
        for i in np.nonzero(~covered)[0]:  # cells no shape touches are never labelled as a shape
            assert T.AUX_SHAPES[shape_lab[i]] in ("none", "text")
            assert colour_lab[i] == 0 and lab["box_on"][i] == 0
        words = {T.AUX_WORDS[w] for w in lab["word"] if w}
        assert words == ({scene.text} if scene.text else set())
        seen_word += bool(words)
    assert seen_word


def test_training_rows_and_targets():
    rng = random.Random(3)
    builder = T.PromptBuilder(DEMO_CHECKPOINT)
    pointed = 0
    for scene in S.make_scenes(8, 30):
        turns = T.sample_turns(scene, rng, 3)
        kinds = [k for k, _, _ in turns]
        assert len(set(turns)) == len(turns) and "describe" not in kinds[:-1]  # a description only last
        ids, labels, starts = builder.row([(q, a) for _, q, a in turns], 16)
        assert len(ids) == len(labels) and len(starts) == len(turns)
        for (_, q, a), k in zip(turns, starts):
            n = len(builder.answer(a))
            assert labels[k:k + n] == ids[k:k + n] == builder.answer(a)  # the answer starts there
            assert labels[k - 1] == -100
            target, cells = T.asked_shape(scene, q), T.asked_cells(scene, q)
            if q.startswith(("Where is", "What color is the", "What is the")) and q != S.BACKGROUND_Q:
                assert target is not None and (target.shape in q or target.colour in q)
                assert cells == T.shape_cells(target) and cells[T.cell_of(*target.center)] == 1
                pointed += 1
            else:
                assert target is None
                assert (cells is not None) == (q == S.TEXT_Q and scene.text is not None)
    assert pointed > 10
    assert T.cell_of(0, 0) == 0 and T.cell_of(127, 127) == 15 and T.cell_of(40, 70) == 2 * 4 + 1
    # harder training scenes share a colour or a kind more often than the evaluation's
    def share(ss):
        return sum(len({s.colour for s in x.shapes}) < x.count or len({s.shape for s in x.shapes}) < x.count
                   for x in ss)

    r = random.Random(1)
    assert share([S.make_scene(r, 3, share=0.9) for _ in range(40)]) > share(S.make_scenes(1, 120)[:40]) + 5


def test_description_phrases_point_at_their_shapes():
    builder = T.PromptBuilder(DEMO_CHECKPOINT)
    checked = 0
    for scene in S.make_scenes(31, 40):
        answer = scene.description()
        enc = builder.tok.tok.encode(answer, add_special_tokens=False)
        pointers = T.phrase_pointers(builder, scene, answer)
        assert [k for k, _ in pointers] == sorted({k for k, _ in pointers})
        cursor = 0
        for s in scene.shapes:  # each phrase's kind word points at that shape's cells, not another's
            at = answer.index(s.phrase(), cursor)
            cursor = at + len(s.phrase())
            kind_at = at + s.phrase().index(s.shape)
            word = next(k for k, (c0, c1) in enumerate(enc.offsets) if c0 <= kind_at < c1)
            assert dict(pointers)[word] == T.shape_cells(s)
            checked += 1
        # "and" between phrases and the final "." point nowhere
        for k, tok in enumerate(enc.tokens):
            if tok.lstrip("Ġ") in ("and", "."):
                assert k not in dict(pointers)
    assert checked > 40


def test_coordinate_targets_spread_over_neighbours_only():
    import torch
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(DEMO_CHECKPOINT / "tokenizer.json"))
    coords = T.coordinate_ids(tok)
    assert len(coords["x"]) == len(coords["y"]) == 128
    vocab = tok.get_vocab_size()
    tg = T.CoordinateTargets(coords, vocab)
    x40 = tg.rows[tg.table[coords["x"][40]]]
    assert torch.isclose(x40.sum(), torch.tensor(1.0)) and int(x40.argmax()) == coords["x"][40]
    assert x40[coords["x"][41]] > x40[coords["x"][43]] > 0 and float(x40[coords["y"][40]]) == 0.0
    # plain tokens keep the plain cross-entropy; a near miss costs less than a far one
    logits = torch.zeros(1, 3, vocab)
    labels = torch.tensor([[-100, 7, coords["x"][40]]])
    base = float(T.CoordinateTargets(coords, vocab, eps=0).loss(logits, labels))
    assert abs(base - math.log(vocab)) < 1e-4
    near, far = logits.clone(), logits.clone()
    near[0, 1, coords["x"][41]] = far[0, 1, coords["x"][60]] = 10.0
    assert float(tg.loss(near, labels)) < float(tg.loss(far, labels))
