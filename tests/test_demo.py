"""The shipped demo model (edgevl/demo/model): layout, size, answers, ncnn == PyTorch, memory, CLI."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import edgevl
from edgevl.demo import DEMO_CHECKPOINT, demo_package
from edgevl.demo import evaluate as E
from edgevl.demo import scenes as S
from edgevl.demo import train as T

RESULT = re.compile(r"^describe_acc=([0-9.]+) count_acc=([0-9.]+) parity=([0-9.]+|nan)$")


def test_shipped_checkpoint_is_real_youtu_vl_layout_and_small():
    names = {p.name for p in DEMO_CHECKPOINT.iterdir()}
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "chat_template.jinja", "generation_config.json", "preprocessor_config.json"):
        assert f in names, f
    total = sum(p.stat().st_size for p in DEMO_CHECKPOINT.iterdir() if p.is_file())
    assert total <= 30 * 2**20, f"demo checkpoint is {total / 2**20:.1f} MB"
    cfg = json.loads((DEMO_CHECKPOINT / "config.json").read_text())
    assert cfg["model_type"] == "youtu_vl" and cfg["architectures"] == ["YoutuVLForConditionalGeneration"]
    v = cfg["vision_config"]
    n_full = len(v["fullatt_block_indexes"])
    assert 1 <= n_full < v["num_hidden_layers"]  # window layers and full-attention layers
    from edgevl.weights import Checkpoint
    keys = set(Checkpoint(DEMO_CHECKPOINT).keys())
    assert any(k.startswith("siglip2.vision_model.encoder.layers.") for k in keys)
    assert {"merger.ln_q.weight", "merger.mlp.0.weight", "model.embed_tokens.weight"} <= keys
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in keys  # MLA
    # the tokenizer carries Youtu-VL's special tokens and the coordinate tokens
    vocab = json.loads((DEMO_CHECKPOINT / "tokenizer.json").read_text())["added_tokens"]
    added = {t["content"] for t in vocab}
    assert {"<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<box>", "</box>", "<x_0>", "<y_127>"} <= added


def test_demo_answers_and_matches_pytorch(capsys):
    """20 fresh scenes (a seed never used in training) through the committed evaluation."""
    assert E.main(["--seed", "4242", "--n", "20", "--show", "3"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    m = RESULT.match(last)
    assert m, last
    describe, count, parity = (float(g) for g in m.groups())
    assert parity == 1.0, last
    # the 200-scene figures in the README are >= 0.9; 20 scenes leave room for chance
    assert describe >= 0.8 and count >= 0.8, last


def test_demo_patch_budget_comes_from_its_preprocessor_config():
    from PIL import Image

    m = edgevl.load(demo_package())
    rows, info = m.vision(Image.new("RGB", (640, 480), "white"))
    gh, gw = info["spatial_shapes"]
    assert gh * gw <= 64 and len(rows) == gh * gw // 4  # trained on 8x8 patches, not 36864


def _iou(a, b):
    ix = max(0, min(a[2], b[2]) - max(a[0], b[0]) + 1)
    iy = max(0, min(a[3], b[3]) - max(a[1], b[1]) + 1)
    area = lambda r: (r[2] - r[0] + 1) * (r[3] - r[1] + 1)  # noqa: E731
    return ix * iy / (area(a) + area(b) - ix * iy)


def test_demo_box_answers_are_boxes_near_the_shape():
    """Grounding is the demo's weakest skill (README: IoU > 0.5 for ~40 %); it must still ground."""
    m = edgevl.load(demo_package())
    ious = []
    for scene in S.make_scenes(5151, 30):
        for q, a in scene.qa():
            if q.startswith("Where is the "):
                got = S.parse_box(edgevl.generate(m, q, image=scene.image, max_new_tokens=16))
                assert got is not None and 0 <= got[0] <= got[2] <= 127 and 0 <= got[1] <= got[3] <= 127, got
                ious.append(_iou(got, S.parse_box(a)))
                break
    assert len(ious) >= 20
    assert sum(i > 0.5 for i in ious) / len(ious) >= 0.25, ious


def test_cli_run_on_demo_scene_under_500mb(tmp_path):
    """`edgevl run --image demo` with no model: converts the shipped model (first run) and answers."""
    env = dict(os.environ, EDGEVL_CACHE=str(tmp_path / "cache"))
    code = ("import resource, subprocess, sys; "
            "r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
            "print(r.returncode); print(r.stdout); print(r.stderr, file=sys.stderr); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    cmd = [sys.executable, "-c", code, sys.executable, "-m", "edgevl.cli", "run", "--image", "demo",
           "--prompt", S.DESCRIBE_Q, "--demo-out", str(tmp_path / "scene.png")]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    lines = r.stdout.strip().splitlines()
    assert lines[0] == "0", r.stderr
    answer = "\n".join(lines[1:-1])
    assert S.parse_description(answer), answer  # names at least one (colour, shape) pair
    assert (tmp_path / "scene.png").is_file()
    peak_mb = int(lines[-1]) / 1024
    print(f"edgevl run on the demo model (incl. first conversion): peak RSS {peak_mb:.0f} MB")
    assert peak_mb < 500, f"peak RSS {peak_mb:.0f} MB"


def test_cell_labels_follow_the_shapes():
    for scene in S.make_scenes(77, 20):
        shape_lab, colour_lab, centre = T.cell_labels(scene)
        assert sum(centre) == scene.count
        assert len(shape_lab) == len(colour_lab) == (S.IMAGE_SIZE // T.CELL) ** 2
        cover = {s.shape + s.colour: (np.asarray(S.shape_mask(s)) > 0).reshape(4, 32, 4, 32).sum(axis=(1, 3))
                 .reshape(-1) for s in scene.shapes}
        for s in scene.shapes:
            cells = cover[s.shape + s.colour]
            for i in np.nonzero(cells >= T.AUX_MIN_PIXELS)[0]:
                if all(cells[i] > c[i] for k, c in cover.items() if k != s.shape + s.colour):
                    # the shape covering most of a cell names it
                    assert T.AUX_SHAPES[shape_lab[i]] == s.shape
                    assert T.AUX_COLOURS[colour_lab[i]] == s.colour
        covered = np.zeros(16, bool)
        for s in scene.shapes:
            covered |= (np.asarray(S.shape_mask(s)) > 0).reshape(4, 32, 4, 32).any(axis=(1, 3)).reshape(-1)
        for i in np.nonzero(~covered)[0]:  # cells no shape touches are never labelled as a shape
            assert T.AUX_SHAPES[shape_lab[i]] in ("none", "text")
            assert colour_lab[i] == 0


@pytest.mark.parametrize("steps", [2])
def test_training_script_runs_and_saves_a_convertible_checkpoint(tmp_path, steps):
    out = tmp_path / "m"
    assert T.main(["--out", str(out), "--steps", str(steps), "--batch", "2", "--threads", "1",
                   "--eval", "0", "--warmup", "1", "--plot", str(tmp_path / "curve.png")]) == 0
    assert (tmp_path / "curve.png").stat().st_size > 1000
    for f in T.RUNTIME_FILES:
        assert (out / f).is_file(), f
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps"] == steps and len(log["history"]) >= 1
    pk = edgevl.convert(out, tmp_path / "pk", dtype="fp32", progress=False)
    scene = S.make_scene(1)
    text = edgevl.generate(edgevl.load(pk), S.DESCRIBE_Q, image=scene.image, max_new_tokens=4)
    assert isinstance(text, str)


def test_demo_scripts_refuse_bad_arguments(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    bad = [(E.main, ["--n", "0", "--no-parity"], "--n must be at least 1"),
           (T.main, ["--out", str(tmp_path / "afile")], "is not a folder"),
           (T.main, ["--out", str(tmp_path / "m"), "--plot", str(tmp_path / "no" / "x.png")], "folder does not exist"),
           (T.main, ["--steps", "0"], "must be at least 1")]
    for fn, argv, msg in bad:
        with pytest.raises(SystemExit) as e:
            fn(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert msg in err.strip().splitlines()[-1] and "Traceback" not in err
    assert not (tmp_path / "m").exists()  # nothing written before the arguments were checked
