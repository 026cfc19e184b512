"""Usage mistakes on the command line: one rule per value in every command, one ``error: ...``
line and exit 2 before any work; the demo scene shorthand and its seed mean the same in run,
verify and chat; a model that needs an image says so when it gets none."""

import io

import pytest

import edgevl
from edgevl import cli as edgevl_cli
from edgevl.chat import chat_loop
from edgevl.demo import demo_package
from edgevl.errors import EdgevlError
from hostile import cli, one_line_error, tiny_checkpoint

# every command that loads a model, with the arguments it requires
COMMANDS = {
    "run": ("run", "--prompt", "hi"),
    "chat": ("chat",),
    "serve": ("serve", "--port", "0"),
    "verify": ("verify",),
    "bench": ("bench",),
    "batch": ("batch", "--input", "in", "--prompt", "hi", "--output", "out.jsonl"),
}


@pytest.fixture
def no_cache(tmp_path, monkeypatch):
    """An empty cache and working folder: a usage error must come before the demo is converted
    and before anything is written."""
    monkeypatch.setenv("EDGEVL_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def nothing_written(folder) -> bool:
    return not any(folder.iterdir())


# -- threads: 0 and negatives are mistakes everywhere (were: the default in run, 1 from the env) --

@pytest.mark.parametrize("value", ["0", "-1"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_threads_zero_or_negative_is_a_usage_error_in_every_command(no_cache, capsys, command, value):
    one_line_error(*cli(capsys, *COMMANDS[command], "--threads", value)[::2],
                   "--threads must be between 1 and", f"got {value}")
    assert nothing_written(no_cache)


@pytest.mark.parametrize("value", ["0", "-2"])
@pytest.mark.parametrize("command", ["run", "bench"])
def test_edgevl_threads_zero_or_negative_is_refused_before_any_work(no_cache, capsys, monkeypatch, command, value):
    monkeypatch.setenv("EDGEVL_THREADS", value)
    one_line_error(*cli(capsys, *COMMANDS[command])[::2], "EDGEVL_THREADS must be between 1 and", f"got {value}")
    assert nothing_written(no_cache)
    from edgevl.runtime import default_threads

    with pytest.raises(EdgevlError, match="EDGEVL_THREADS must be between 1 and"):
        default_threads()


def test_threads_zero_in_the_python_chat_and_verify(tmp_path):
    pkg = edgevl.convert(tiny_checkpoint(tmp_path / "ck"), tmp_path / "pk", dtype="fp32", progress=False)
    with pytest.raises(EdgevlError, match="threads must be between 1 and"):
        chat_loop(pkg, threads=0, input_fn=lambda _: "/quit", out=io.StringIO())
    pytest.importorskip("torch")
    from edgevl.verification.verify import compare

    with pytest.raises(EdgevlError, match="threads must be between 1 and"):
        compare(pkg, tmp_path / "ck", "hi", threads=0)


# -- argparse values: the same one line as every other mistake (was: argparse's usage + error) ----

@pytest.mark.parametrize("args,needle", [
    (("run", "--prompt", "hi", "--max-new-tokens", "-1"), "--max-new-tokens must be >= 0, got -1"),
    (("run", "--prompt", "hi", "--max-new-tokens", "many"), "--max-new-tokens must be an integer, got 'many'"),
    (("run", "--prompt", "hi", "--threads", "two"), "--threads must be an integer, got 'two'"),
    (("verify", "--seed", "-3"), "--seed must be >= 0, got -3"),
])
def test_bad_integer_flags_are_one_line(no_cache, capsys, args, needle):
    code, _, err = cli(capsys, *args)
    one_line_error(code, err, needle)
    assert "usage:" not in err and nothing_written(no_cache)


# -- convert --help tells what q8 is now ------------------------------------------------------

def test_convert_help_describes_q8_as_int8_with_per_row_activations(capsys):
    with pytest.raises(SystemExit) as e:
        edgevl_cli.main(["convert", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "block-quantized" not in text
    assert "q8: int8 weights" in text and "activations quantized per row at run time" in text


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
