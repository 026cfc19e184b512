"""The demo model's training and evaluation scripts (edgevl.verification.demo_train and
demo_evaluate): the evaluation's scoring, a short training run that saves a convertible
checkpoint, bad arguments refused before any work, and the first progress line before loading."""

import json
import math
from pathlib import Path

import pytest

import edgevl
from edgevl.demo import scenes as S
from edgevl.verification import demo_evaluate as E
from edgevl.verification import demo_train as T


def test_evaluation_scoring():
    scene = S.make_scene(5)
    truth = {k: (q, a) for k, q, a in scene.qa_items()}
    q, a = truth["where"]
    x1, y1, x2, y2 = S.parse_box(a)
    assert E.judge("where", a, a, scene) == ("grounding", True)
    assert E.judge("where", f"<box><x_{x1 + 1}><y_{y1}><x_{x2}><y_{y2 + 1}></box>", a, scene)[1]
    assert not E.judge("where", f"<box><x_{x2}><y_{y2}><x_{min(127, x2 + 30)}><y_{min(127, y2 + 30)}></box>",
                       a, scene)[1]
    assert not E.judge("where", "A circle.", a, scene)[1]
    assert E.iou((0, 0, 9, 9), (0, 0, 9, 9)) == 1.0 and E.iou((0, 0, 9, 9), (10, 10, 19, 19)) == 0.0
    assert E.iou((0, 0, 9, 9), (5, 0, 14, 9)) == 50 / 150
    assert E.judge("colour", "Red.", "Red.", scene)[1] and not E.judge("colour", "Blue.", "Red.", scene)[1]
    assert E.judge("shape", "A large star.", "A small star.", scene)[1]  # the skill is the shape
    assert not E.judge("shape", "A small circle.", "A small star.", scene)[1]
    assert E.judge("background", "Light grey.", "Light grey.", scene)[1]
    assert not E.judge("background", "White.", "Light grey.", scene)[1]
    worded = next(s for s in S.make_scenes(9, 50) if s.text)
    assert E.judge("text", f"{worded.text}.", f"{worded.text}.", worded) == ("reading", True)
    assert E.judge("text", "Nothing.", f"{worded.text}.", worded) == ("reading", False)
    plain = next(s for s in S.make_scenes(9, 50) if not s.text)
    assert E.judge("text", "Nothing.", "Nothing.", plain) == ("nothing", True)
    t = E.Tally()
    t.add("grounding", True), t.add("grounding", False)
    assert t.acc("grounding") == 0.5 and math.isnan(t.acc("parity"))
    assert t.summary().startswith("describe_acc=nan count_acc=nan grounding_acc=0.5000 parity=nan ")
    # the grounding detail: right, on another shape, on no shape, and the random-shape chance
    two = next(s for s in S.make_scenes(11, 50) if s.count == 2 and s.shapes[0].shape != s.shapes[1].shape)
    a, b = two.shapes
    truth = S.box_answer(a.bbox)
    for answer in (truth, S.box_answer(b.bbox), "<box><x_0><y_0><x_1><y_1></box>", "no box"):
        t.add_where(answer, truth, two)
    assert t.where[:6] == [4, 1, 1, 2, 0, 0] and t.where[6] == 4 * 0.5, t.where
    assert any("1/4 boxes on another shape of the scene, 2/4 on no shape" in line for line in t.lines())


def safetensors_numpy(path) -> dict:
    from safetensors.numpy import load_file

    return load_file(str(path))


@pytest.mark.parametrize("steps", [2])
def test_training_script_runs_and_saves_a_convertible_checkpoint(tmp_path, steps, monkeypatch):
    out = tmp_path / "m"
    # a few steps of each phase (vision pretraining, then the language model), as fast as possible
    assert T.main(["--out", str(out), "--steps", str(steps), "--vision-steps", "2", "--batch", "2", "--threads", "1",
                   "--eval", "0", "--warmup", "1", "--plot", str(tmp_path / "curve.png"), "--no-freeze-vision"]) == 0
    assert (tmp_path / "curve.png").stat().st_size > 1000
    for f in T.RUNTIME_FILES:
        assert (out / f).is_file(), f
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps"] == steps and len(log["history"]) >= 1 and log["cpu_seconds"] > 0
    # both phases ran: the vision tower on the cell probes, then the language model with the
    # training-only losses (cell probes, attention on the asked shape)
    assert log["vision_steps"] == 2 and log["vision_history"][-1]["step"] == 2 and not log["freeze_vision"]
    assert {"cell_shape_acc", "cell_box_acc", "attention_mass", "probe_loss"} <= set(log["history"][-1])
    pk = edgevl.convert(out, tmp_path / "pk", dtype="fp32", progress=False)
    scene = S.make_scene(1)
    text = edgevl.generate(edgevl.load(pk), S.DESCRIBE_Q, image=scene.image, max_new_tokens=4)
    assert isinstance(text, str)
    # continuing from a checkpoint keeps its tokenizer and writes a new folder
    cont = tmp_path / "c"
    # (the shipped model's second run: frozen tower, attention targets on descriptions too)
    before = safetensors_numpy(out / "model.safetensors")
    assert T.main(["--init", str(out), "--out", str(cont), "--steps", "2", "--batch", "2", "--threads", "1",
                   "--eval", "0", "--warmup", "1", "--freeze-vision", "--phrase-attention",
                   "--weights", "describe=1,where=0"]) == 0
    assert (cont / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()
    clog = json.loads((cont / "train_log.json").read_text())
    assert clog["init"] == str(out) and clog["freeze_vision"] and clog["phrase_attention"]
    assert clog["kind_weights"]["describe"] == 1 and clog["kind_weights"]["where"] == 0
    both = T.combine_logs(log, clog)
    assert [h["step"] for h in both["history"]][-1] == steps + 2 and both["seconds"] == log["seconds"] + clog["seconds"]
    T.plot_log(both, tmp_path / "both.png")
    assert (tmp_path / "both.png").stat().st_size > 1000
    after = safetensors_numpy(cont / "model.safetensors")
    frozen = [k for k in before if k.startswith(("siglip2.", "merger."))]
    assert frozen and all((before[k] == after[k]).all() for k in frozen)          # the tower did not move
    assert any((before[k] != after[k]).any() for k in before if k.startswith("model.layers."))
    # with no --out a new folder is made; the shipped model is never the default
    monkeypatch.chdir(tmp_path)
    assert T.default_out() == Path("demo-model-1")


def test_demo_scripts_refuse_bad_arguments(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    bad = [(E.main, ["--n", "0", "--no-parity"], "--n must be at least 1"),
           (T.main, ["--out", str(tmp_path / "afile")], "is not a folder"),
           (T.main, ["--out", str(tmp_path / "model")], "already holds a model; pass --overwrite"),
           (T.main, ["--out", str(tmp_path / "m"), "--init", str(tmp_path / "nothing")], "no config.json there"),
           (T.main, ["--out", str(tmp_path / "model"), "--init", str(tmp_path / "model"), "--overwrite"],
            "same folder"),
           (T.main, ["--out", str(tmp_path / "m"), "--plot", str(tmp_path / "no" / "x.png")], "folder does not exist"),
           (T.main, ["--steps", "0"], "must be at least 1"),
           (T.main, ["--out", str(tmp_path / "m"), "--weights", "dance=1"], "write KIND=NUMBER"),
           (T.main, ["--out", str(tmp_path / "m"), "--weights", "shape=-1"], "a number >= 0"),
           (T.main, ["--out", str(tmp_path / "m"), "--weights", "count=0"], "need a weight above 0")]
    for fn, argv, msg in bad:
        with pytest.raises(SystemExit) as e:
            fn(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert msg in err.strip().splitlines()[-1] and "Traceback" not in err
    assert not (tmp_path / "m").exists()  # nothing written before the arguments were checked
    assert (tmp_path / "model" / "config.json").read_text() == "{}"


def test_demo_evaluate_prints_its_first_line_before_loading(capsys, monkeypatch):
    seen = []

    def loading(*a, **k):
        seen.append(capsys.readouterr().out)
        raise SystemExit(3)

    monkeypatch.setattr(E, "resolve", loading)
    with pytest.raises(SystemExit):
        E.main(["--n", "1", "--no-parity"])
    assert seen and seen[0].startswith("[0/1] evaluating 1 scenes"), seen
