"""Every option value is checked before a command does anything: no demo scene drawn, no output
file written, no model loaded, and (for values that do not depend on the model) not even the demo
model converted into the cache."""

import shutil

import pytest

from edgevl import model as model_module
from edgevl.demo import DEMO_CHECKPOINT, demo_package
from edgevl.demo.scenes import make_scene
from support.cli import cli, one_line_error


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """An empty working folder; loading a model there is a test failure."""
    demo_package()   # the shared test cache's demo, for the checks that read its manifest

    def no_loading(self, *args, **kwargs):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(model_module.Model, "__init__", no_loading)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


def fresh_cache(tmp_path, monkeypatch):
    cache = tmp_path / "fresh-cache"
    monkeypatch.setenv("EDGEVL_CACHE", str(cache))
    return cache


# values wrong whatever the model: refused before the demo model is even converted
ANY_MODEL = [
    (("--temperature", "-1"), "temperature must be a finite number >= 0"),
    (("--top-p", "2"), "top_p must be in (0, 1]"),
    (("--min-p", "2"), "min_p must be in [0, 1]"),
    (("--top-k", "-1"), "top_k must be >= 0"),
    (("--repetition-penalty", "0"), "repetition_penalty must be a finite number > 0"),
    (("--seed", "-1"), "seed must be an integer >= 0"),
    (("--draft-tokens", "0"), "--draft-tokens must be >= 1, got 0"),
    (("--draft-vocab", "-1"), "--draft-vocab must be >= 0, got -1"),
    (("--prefill-chunk", "0"), "prefill_chunk must be >= 1, got 0"),
    (("--expert-cache-mb", "-1"), "expert_cache_mb must be >= 0, got -1"),
    (("--image", "missing.png"), "missing.png"),
    (("--video", "missing.mp4"), "missing.mp4"),
    (("--max-new-tokens", "0"), "--max-new-tokens must be >= 1, got 0"),
    (("--seed", "x"), "--seed must be an integer, got 'x'"),
    (("--top-k", "2.5"), "--top-k must be an integer"),
    (("--temperature", "warm"), "--temperature must be a number, got 'warm'"),
    (("--top-p", "x"), "--top-p must be a number"),
    (("--min-p", "x"), "--min-p must be a number"),
    (("--repetition-penalty", "x"), "--repetition-penalty must be a number"),
    (("--max-image-patches", "big"), "--max-image-patches must be an integer"),
    (("--max-image-patches", "0"), "--max-image-patches must be between 4 and"),
]


@pytest.mark.parametrize("args,needle", ANY_MODEL, ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_run_refuses_before_drawing_the_scene_or_converting_the_demo(workdir, tmp_path, monkeypatch, capsys, args,
                                                                   needle):
    cache = fresh_cache(tmp_path, monkeypatch)
    one_line_error(*cli(capsys, "run", "--image", "demo", "--prompt", "hi", *args)[::2], needle)
    assert list(workdir.iterdir()) == [] and not cache.exists()


def test_an_empty_prompt_is_refused_before_any_work(workdir, tmp_path, monkeypatch, capsys):
    cache = fresh_cache(tmp_path, monkeypatch)
    one_line_error(*cli(capsys, "run", "--image", "demo", "--prompt", "  ")[::2], "--prompt is empty")
    assert list(workdir.iterdir()) == [] and not cache.exists()


# values the package refuses (the demo: no MTP block, no routed experts, no video): read from its
# manifest before the scene is drawn or the model loaded
THIS_MODEL = [
    (("--speculative", "mtp"), "MTP"),
    (("--draft-tokens", "2"), "MTP"),
    (("--expert-cache-mb", "64"), "no option 'expert_cache_mb'"),
    (("--video", "clip"), "takes no video"),
]


@pytest.mark.parametrize("args,needle", THIS_MODEL, ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_run_checks_the_package_before_drawing_the_scene_or_loading(workdir, capsys, args, needle):
    (workdir / "clip").mkdir()   # a folder of frames, present
    one_line_error(*cli(capsys, "run", "--image", "demo", "--prompt", "hi", *args)[::2], needle)
    assert [p.name for p in workdir.iterdir()] == ["clip"]


def test_draw_boxes_without_an_image_is_refused_before_the_answer(workdir, tmp_path, monkeypatch, capsys):
    cache = fresh_cache(tmp_path, monkeypatch)
    one_line_error(*cli(capsys, "run", "--prompt", "hi", "--draw-boxes", "boxes.png")[::2],
                   "--draw-boxes needs --image")
    assert list(workdir.iterdir()) == [] and not cache.exists()


def test_image_paths_as_file_urls_and_fifos(workdir, tmp_path, monkeypatch, capsys):
    """--image takes a file:// URL (as a file manager copies it); a FIFO is not taken for a missing
    file, nor opened (it would block)."""
    import os

    fresh_cache(tmp_path, monkeypatch)
    os.mkfifo(workdir / "pipe.png")
    one_line_error(*cli(capsys, "run", "--image", "pipe.png", "--prompt", "hi")[::2], "is not a regular file")
    one_line_error(*cli(capsys, "run", "--image", (workdir / "gone.png").as_uri(), "--prompt", "hi")[::2],
                   "image not found")
    one_line_error(*cli(capsys, "run", "--image", "", "--prompt", "hi")[::2], "--image is empty")
    one_line_error(*cli(capsys, "run", "--image", "https://example.com/a.png", "--prompt", "hi")[::2],
                   "https:// URLs are not read")
    code, err = cli(capsys, "run", "--image", "y" * 5000, "--prompt", "hi")[::2]
    one_line_error(code, err, "image not found: " + "y" * 200 + "...")
    assert len(err) < 400, len(err)
    one_line_error(*cli(capsys, "run", "--video", " ", "--prompt", "hi")[::2], "--video is empty")
    make_scene(1).image.save(workdir / "a b.png")
    with pytest.raises(AssertionError, match="a model was loaded"):     # checked, and taken: the model loads
        cli(capsys, "run", "--image", (workdir / "a b.png").as_uri(), "--prompt", "hi")


def test_run_never_draws_over_its_input_image(workdir, tmp_path, monkeypatch, capsys):
    """--draw-boxes (and --demo-out) naming an --image, by any spelling, is refused before the
    model loads: the user's picture is not replaced."""
    import hashlib
    import os

    fresh_cache(tmp_path, monkeypatch)
    make_scene(1).image.save(workdir / "photo.png")
    (workdir / "sub").mkdir()
    os.symlink(workdir / "photo.png", workdir / "link.png")
    before = hashlib.sha256((workdir / "photo.png").read_bytes()).hexdigest()
    for image, out in (("photo.png", "photo.png"), ("photo.png", "sub/../photo.png"), ("link.png", "photo.png"),
                       ((workdir / "photo.png").as_uri(), str(workdir / "photo.png"))):
        one_line_error(*cli(capsys, "run", "--image", image, "--prompt", "hi", "--draw-boxes", out)[::2],
                       f"--draw-boxes {out} is the input image", "choose another --draw-boxes")
    one_line_error(*cli(capsys, "run", "--image", "photo.png", "--image", "demo", "--prompt", "hi",
                        "--demo-out", "photo.png")[::2], "--demo-out photo.png is the input image")
    assert hashlib.sha256((workdir / "photo.png").read_bytes()).hexdigest() == before
    # the scene's default name too, in run and verify
    make_scene(2).image.save(workdir / "demo_scene.png")
    for command in ("run", "verify"):
        one_line_error(*cli(capsys, command, "--image", "demo_scene.png", "--image", "demo", "--prompt", "hi")[::2],
                       "--demo-out demo_scene.png is the input image")
    # OUT-1 is written only when there are several scenes: one scene beside an input named so is fine
    from edgevl.cli import check_not_inputs
    from edgevl.errors import EdgevlError

    check_not_inputs(["demo", "scene-1.png"], None, "scene.png")
    with pytest.raises(EdgevlError, match="--demo-out scene-2.png is the input image"):
        check_not_inputs(["demo", "demo", "scene-2.png"], None, "scene.png")   # scene 2 (the second demo) goes there


def test_serve_values_are_one_line(workdir, capsys):
    for args, needle in ((("--port", "http"), "--port must be an integer"), (("--port", "-1"), "--port must be >= 0"),
                         (("--parallel", "x"), "--parallel must be an integer"),
                         (("--max-queue", "1.5"), "--max-queue must be an integer"),
                         (("--max-tokens", "x"), "--max-tokens must be an integer"),
                         (("--shutdown-grace", "soon"), "--shutdown-grace must be a number")):
        one_line_error(*cli(capsys, "serve", *args)[::2], needle)


def test_chat_refuses_before_loading(workdir, tmp_path, monkeypatch, capsys):
    cache = fresh_cache(tmp_path, monkeypatch)
    one_line_error(*cli(capsys, "chat", "--temperature", "-1")[::2], "temperature must be a finite number >= 0")
    one_line_error(*cli(capsys, "chat", "--image", "missing.png")[::2], "missing.png")
    assert not cache.exists()


def test_batch_refuses_before_writing_the_output(workdir, tmp_path, monkeypatch, capsys):
    (workdir / "in").mkdir()
    make_scene(1).image.save(workdir / "in" / "scene.png")
    base = ["batch", "--input", "in", "--prompt", "hi", "--output", "out.jsonl"]
    one_line_error(*cli(capsys, *base, "--draft-tokens", "2")[::2], "MTP")   # the demo has no MTP block
    cache = fresh_cache(tmp_path, monkeypatch)
    one_line_error(*cli(capsys, *base, "--temperature", "-1")[::2], "temperature must be a finite number >= 0")
    one_line_error(*cli(capsys, *base, "--workers", "-1")[::2], "--workers must be >= 1")
    one_line_error(*cli(capsys, *base, "--max-new-tokens", "0")[::2], "--max-new-tokens must be >= 1")
    blank = [a if a != "hi" else "   " for a in base]
    one_line_error(*cli(capsys, *blank)[::2], "--prompt is empty")
    assert sorted(p.name for p in workdir.iterdir()) == ["in"] and not cache.exists()


def test_bench_refuses_before_running_or_converting(workdir, tmp_path, monkeypatch, capsys):
    ck = tmp_path / "ck"
    shutil.copytree(DEMO_CHECKPOINT, ck)   # a checkpoint folder: bench converts it beside itself
    base = ["bench", ck, "--repeats", "1", "--prompt-tokens", "4", "--gen-tokens", "1"]
    one_line_error(*cli(capsys, *base, "--compare", "nonsense")[::2], "unknown --compare system 'nonsense'")
    one_line_error(*cli(capsys, *base, "--images", "640by480")[::2], "--images takes sizes like")
    one_line_error(*cli(capsys, *base, "--json", tmp_path / "missing" / "r.json")[::2], "does not exist")
    one_line_error(*cli(capsys, *base, "--markdown", tmp_path)[::2], "is a folder")
    one_line_error(*cli(capsys, *base, "--plot", tmp_path / "plot.notanimage")[::2], "no image extension")
    one_line_error(*cli(capsys, *base, "--draft-tokens", "0")[::2], "--draft-tokens must be >= 1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "work"]   # no ck-edgevl-bf16
    one_line_error(*cli(capsys, "bench", "--speculative", "mtp", "--repeats", "1")[::2], "MTP")   # the demo


def test_low_memory_on_a_decoder_that_cannot_is_refused_before_the_scene(workdir, tmp_path, capsys, monkeypatch):
    import edgevl
    from edgevl.random_model import write

    pkg = edgevl.convert(write("qwen3_5", tmp_path / "ck"), tmp_path / "pkg", progress=False)
    one_line_error(*cli(capsys, "run", pkg, "--image", "demo", "--prompt", "hi", "--low-memory")[::2],
                   "does not support qwen3_5's decoder", "without recurrent layers", "run without --low-memory")
    assert list(workdir.iterdir()) == []
    from edgevl import bench

    def no_run(*args, **kwargs):
        raise AssertionError("bench measured before refusing --low-memory")

    monkeypatch.setattr(bench, "_run_worker", no_run)
    one_line_error(*cli(capsys, "bench", pkg, "--low-memory", "--repeats", "1", "--prompt-tokens", "4",
                        "--gen-tokens", "1")[::2], "run without --low-memory")


def test_bench_converts_a_checkpoint_again_once_it_changed(tmp_path, capsys):
    """bench converts a checkpoint into CK-edgevl-bf16 once; a later bench of a checkpoint that
    changed there (config, weight files) converts it again rather than timing the old model."""
    import os

    import edgevl
    from edgevl.bench import _converted_from_other

    ck = tmp_path / "ck"
    shutil.copytree(DEMO_CHECKPOINT, ck)
    pkg = edgevl.convert(ck, tmp_path / "ck-edgevl-bf16", dtype="bf16", progress=False)
    assert _converted_from_other(pkg, ck) is None
    weights = next(ck.glob("*.safetensors"))
    os.utime(weights)   # written again, the same bytes: no conversion
    assert _converted_from_other(pkg, ck) is None
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert _converted_from_other(pkg, ck) == f"the checkpoint's {weights.name} changed"
    weights.rename(ck / "other.safetensors")
    assert _converted_from_other(pkg, ck) == "the checkpoint's weight files changed"
    edit_json = (ck / "config.json").read_text().replace("{", '{"x": 1, ', 1)
    (ck / "config.json").write_text(edit_json)
    assert _converted_from_other(pkg, ck) == "the checkpoint's config.json changed"
    # a folder of that name that is not a package is left alone, and bench says what to do
    other = tmp_path / "b"
    shutil.copytree(DEMO_CHECKPOINT, other)
    (tmp_path / "b-edgevl-bf16").mkdir()
    one_line_error(*cli(capsys, "bench", other, "--repeats", "1")[::2], "b-edgevl-bf16 is there and is not an "
                   "edgevl package")


def test_file_system_errors_are_one_line_with_the_fix(tmp_path, capsys, monkeypatch):
    """A full disk, a path through a file: one line naming the path and what to do."""
    import errno
    import sys

    convert_module = sys.modules["edgevl.convert"]

    (tmp_path / "afile").write_text("")
    one_line_error(*cli(capsys, "convert", DEMO_CHECKPOINT, tmp_path / "afile" / "pk", "--quiet")[::2],
                   "afile", "that is a file, not a folder: choose another path")

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out" / "decoder.bin"))

    monkeypatch.setattr(convert_module, "convert", full)
    one_line_error(*cli(capsys, "convert", DEMO_CHECKPOINT, tmp_path / "out", "--quiet")[::2],
                   "No space left on device", "decoder.bin", "free some space on that disk")


@pytest.fixture(scope="module")
def text_package(tmp_path_factory):
    import edgevl
    from support.youtu import tiny_checkpoint

    root = tmp_path_factory.mktemp("text-only")
    return edgevl.convert(tiny_checkpoint(root / "ck"), root / "pkg", dtype="fp32", progress=False)


@pytest.mark.parametrize("command", ["run", "verify"])
def test_an_image_for_a_text_only_model_is_refused_before_the_scene_is_saved(text_package, workdir, capsys,
                                                                             command):
    one_line_error(*cli(capsys, command, text_package, "--image", "demo", "--prompt", "What is this?")[::2],
                   "has no vision tower")
    assert not list(workdir.iterdir())   # no demo_scene.png


def test_bench_refuses_what_its_workers_would_fail_on(text_package, workdir, capsys):
    """Images for a text-only package, a prompt past the context: one line before any run (they
    failed inside a worker, leaving its log behind)."""
    one_line_error(*cli(capsys, "bench", text_package, "--images", "64x64", "--repeats", "1")[::2],
                   "has no vision tower")
    one_line_error(*cli(capsys, "bench", text_package, "--prompt-tokens", "100000", "--repeats", "1")[::2],
                   "do not fit", "context of")


def test_a_full_temporary_disk_and_a_deleted_folder_are_named(tmp_path, capsys, monkeypatch):
    """OSErrors that carry no path: a full disk is said to be the output's or the temporary
    folder's (named), and a working folder deleted under the command is said to be gone."""
    import errno
    import sys
    import tempfile

    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    one_line_error(*cli(capsys, "convert", DEMO_CHECKPOINT, "relative-out", "--quiet")[::2],
                   "current folder was deleted")
    monkeypatch.chdir(tmp_path)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sys.modules["edgevl.convert"], "convert", full)
    one_line_error(*cli(capsys, "convert", DEMO_CHECKPOINT, tmp_path / "out", "--quiet")[::2],
                   "No space left on device", tempfile.gettempdir(), "TMPDIR")


def test_text_the_terminal_cannot_hold_is_escaped_not_a_traceback(tmp_path):
    """PYTHONIOENCODING=ascii (or a Latin-1 console): the answer and messages print escaped."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONIOENCODING": "ascii", "EDGEVL_CACHE": str(tmp_path / "cache")}
    pkg = tmp_path / "pk 包"
    r = subprocess.run([sys.executable, "-m", "edgevl", "convert", str(DEMO_CHECKPOINT), str(pkg), "--quiet"],
                       capture_output=True, env=env, timeout=600)
    assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr.decode()[-800:]
    assert b"\\u5305" in r.stdout + r.stderr                  # the folder's name, escaped
    (tmp_path / "s.json").write_text('{"enum": ["caf\\u00e9"]}')       # an answer that is not ASCII
    r = subprocess.run([sys.executable, "-m", "edgevl", "run", str(pkg), "--prompt", "你好", "--json-schema",
                        str(tmp_path / "s.json")], capture_output=True, env=env, timeout=600)
    assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr.decode()[-800:]
    assert b'"caf\\xe9"' in r.stdout, r.stdout


def test_no_writable_temporary_folder_says_to_set_tmpdir(capsys, monkeypatch):
    """What tempfile raises in a read-only container without a tmpfs."""
    def none_usable():
        raise FileNotFoundError(2, "No usable temporary directory found in ['/tmp', '/var/tmp']")

    from edgevl import cli as cli_module

    monkeypatch.setattr(cli_module, "cmd_convert", lambda a: none_usable(), raising=False)
    code, _, err = cli(capsys, "convert", DEMO_CHECKPOINT, "out", "--quiet")
    one_line_error(code, err, "set TMPDIR")
