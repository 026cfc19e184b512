"""Images on the command line: the demo scene shorthand (--image demo) and its seed mean the same
in run, verify and chat; a model that needs an image says so when it gets none."""

import io

import pytest

import edgevl
from edgevl.chat import chat_loop
from edgevl.demo import demo_package
from support.cli import cli
from support.youtu import tiny_checkpoint

# -- the demo scene: --image demo and --seed mean the same in run, verify and chat ---------------

def test_verify_and_chat_draw_runs_demo_scene_for_the_same_seed(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(capsys, "run", "--image", "demo", "--seed", "37", "--prompt", "Describe the image.",
                       "--max-new-tokens", "1", "--demo-out", "run.png")
    assert code == 0, err
    scene = (tmp_path / "run.png").read_bytes()
    # verify took 'demo' for a file name and failed
    code, _, err = cli(capsys, "verify", "--image", "demo", "--seed", "37", "--max-new-tokens", "1",
                       "--demo-out", "verify.png")
    assert code == 0, err
    assert "[demo scene saved to verify.png]" in err and (tmp_path / "verify.png").read_bytes() == scene
    # chat drew a random scene whatever the seed
    lines = iter(["/quit"])
    assert chat_loop(demo_package(), image="demo", seed=37, input_fn=lambda _: next(lines), out=io.StringIO()) == 0
    assert (tmp_path / "demo_scene.png").read_bytes() == scene


def test_the_kth_image_is_scene_seed_plus_k_everywhere(tmp_path, monkeypatch):
    """Several images: the k-th of a command (counted over all of them) is scene seed + k; chat
    counts the images attached so far, so its second image is run's second."""
    from PIL import Image

    from edgevl.demo.scene_file import demo_images

    monkeypatch.chdir(tmp_path)
    Image.new("RGB", (32, 32)).save("photo.png")
    images, saved = demo_images(["photo.png", "demo", "demo"], 37, "s.png")
    assert images == ["photo.png", "s-2.png", "s-3.png"] and [p.name for p in saved] == ["s-2.png", "s-3.png"]
    lines = iter(["/image demo", "/quit"])
    chat_loop(demo_package(), image="photo.png", seed=37, input_fn=lambda _: next(lines), out=io.StringIO())
    assert (tmp_path / "demo_scene.png").read_bytes() == (tmp_path / "s-2.png").read_bytes()


# -- a model trained on images only says so when it gets none ----------------------------------

NOTE = "note: this model was trained on images only; its answer without --image is not meaningful"


def test_demo_run_without_an_image_prints_the_note(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(capsys, "run", "--prompt", "Describe the image.", "--max-new-tokens", "2")
    assert code == 0 and out.strip() and err.strip().splitlines()[-1] == NOTE, err
    code, _, err = cli(capsys, "run", "--image", "demo", "--seed", "3", "--prompt", "Describe the image.",
                       "--max-new-tokens", "2")
    assert code == 0 and "note:" not in err, err
    assert edgevl.load(demo_package()).manifest["needs_image"] is True   # the demo's package says it


def test_the_note_comes_from_the_package_not_the_family(tmp_path, capsys):
    """A package converted with needs_image says so; the same checkpoint converted plainly (any
    other model) prints nothing."""
    ck = tiny_checkpoint(tmp_path / "ck")
    plain = edgevl.convert(ck, tmp_path / "plain", dtype="fp32", progress=False)
    marked = edgevl.convert(ck, tmp_path / "marked", dtype="fp32", progress=False, needs_image=True)
    code, _, err = cli(capsys, "run", plain, "--prompt", "hi", "--max-new-tokens", "2")
    assert code == 0 and "note:" not in err, err
    code, _, err = cli(capsys, "run", marked, "--prompt", "hi", "--max-new-tokens", "2")
    assert code == 0 and NOTE in err, err


def test_demo_chat_without_an_image_notes_it_once_per_conversation(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    model = edgevl.load(demo_package())
    lines = iter(["Describe the image.", "And now?", "/reset", "Hello", "/quit"])
    chat_loop(model, max_new_tokens=2, input_fn=lambda _: next(lines), out=io.StringIO())
    err = capsys.readouterr().err
    assert err.count("note: this model was trained on images only") == 2, err   # before turn 1 and after /reset
    lines = iter(["Describe the image.", "/quit"])
    chat_loop(model, image="demo", seed=3, max_new_tokens=2, input_fn=lambda _: next(lines), out=io.StringIO())
    assert "note:" not in capsys.readouterr().err


def test_a_thinking_switch_the_model_lacks_is_said(tmp_path, monkeypatch, capsys):
    """Youtu models have no thinking switch in their template: --no-thinking is said to do
    nothing (it was ignored without a word); a model that has one (Qwen3.5) takes it silently."""
    from edgevl.random_model import write_qwen3_5

    monkeypatch.chdir(tmp_path)
    for flag in ("--thinking", "--no-thinking"):
        code, _, err = cli(capsys, "run", "--image", "demo", "--prompt", "hi", "--max-new-tokens", "2", flag)
        assert code == 0 and f"no thinking switch in its chat template; {flag} changes nothing" in err, err
    (tmp_path / "ck").mkdir()
    write_qwen3_5(tmp_path / "ck", seed=0)
    pkg = edgevl.convert(tmp_path / "ck", tmp_path / "pkg", dtype="fp32", progress=False)
    code, _, err = cli(capsys, "run", pkg, "--prompt", "hi", "--max-new-tokens", "2", "--no-thinking")
    assert code == 0 and "thinking switch" not in err, err
