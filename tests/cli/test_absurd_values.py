"""Absurd command-line values: one line and exit 2, never a crash or a traceback."""

import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

import edgevl
from edgevl.errors import EdgevlError
from edgevl.models.youtu_vl.processing import preprocess
from edgevl.processing.image import MAX_IMAGE_PATCHES
from support.cli import cli, one_line_error
from support.youtu import tiny_checkpoint


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-cli")
    return edgevl.convert(tiny_checkpoint(root / "ck"), root / "pkg", dtype="fp32", progress=False)


def run(capsys, pkg, *extra, prompt="hi"):
    return cli(capsys, "run", pkg, "--prompt", prompt, "--max-new-tokens", "3", *extra)


def test_threads_100000_is_refused_not_a_segfault(pkg):
    """Was a segfault inside ncnn: run in a subprocess so a regression cannot take pytest down."""
    r = subprocess.run([sys.executable, "-m", "edgevl", "run", str(pkg), "--prompt", "hi", "--threads", "100000"],
                       capture_output=True, text=True, timeout=120)
    one_line_error(r.returncode, r.stderr, "--threads must be between 1 and")


@pytest.mark.parametrize("case", [
    ("threads-negative", ("--threads", "-3"), "--threads must be between 1 and"),
    ("threads-zero", ("--threads", "0"), "--threads must be between 1 and"),   # was: the default, silently
    ("threads-huge", ("--threads", str(10 ** 12)), "--threads must be between 1 and"),
    ("patches-1e9", ("--max-image-patches", "1000000000"), f"between 4 and {MAX_IMAGE_PATCHES}"),
    ("patches-zero", ("--max-image-patches", "0"), "--max-image-patches must be between 4"),
    ("temperature-nan", ("--temperature", "nan"), "temperature must be a finite number"),
    ("temperature-inf", ("--temperature", "inf"), "temperature must be a finite number"),
    ("temperature-negative", ("--temperature", "-1"), "temperature must be a finite number >= 0"),
    ("top-p-nan", ("--top-p", "nan"), "top_p must be in (0, 1]"),
    ("repetition-nan", ("--repetition-penalty", "nan"), "repetition_penalty must be a finite number > 0"),
    ("seed-negative", ("--seed", "-1"), "seed must be an integer >= 0"),
    ("top-k-negative", ("--top-k", "-2"), "top_k must be >= 0"),
], ids=lambda c: c[0])
def test_absurd_flag_values(pkg, capsys, case):
    one_line_error(*run(capsys, pkg, *case[1])[::2], case[2])


def test_threads_env_is_bounded_too(pkg, capsys, monkeypatch):
    monkeypatch.setenv("EDGEVL_THREADS", "100000")
    one_line_error(*run(capsys, pkg)[::2], "EDGEVL_THREADS must be between 1 and")
    monkeypatch.setenv("EDGEVL_THREADS", "0")  # was: 1 thread, silently
    one_line_error(*run(capsys, pkg)[::2], "EDGEVL_THREADS must be between 1 and", "got 0")
    monkeypatch.setenv("EDGEVL_THREADS", "100000")
    with pytest.raises(EdgevlError, match="threads must be between 1 and"):
        edgevl.load(pkg, threads=100000)


def test_denormal_temperature_is_greedy(pkg, capsys):
    code, greedy, err = run(capsys, pkg, "--temperature", "0", "--raw")
    assert code == 0, err
    for t in ("1e-320", "5e-324", "1e-200"):
        code, out, err = run(capsys, pkg, "--temperature", t, "--raw", "--seed", "1")
        assert code == 0 and out == greedy, (t, err)


def test_image_patch_budget_is_bounded_in_the_api():
    im = Image.new("RGB", (64, 64))
    with pytest.raises(EdgevlError, match=f"above the supported maximum {MAX_IMAGE_PATCHES}"):
        preprocess(im, 10 ** 9)
    with pytest.raises(EdgevlError, match="max_image_patches must be an integer"):
        preprocess(im, "64")
    assert preprocess(im, MAX_IMAGE_PATCHES)["spatial_shapes"] == (4, 4)  # the maximum itself is fine


@pytest.mark.parametrize("flag", ["--demo-out", "--draw-boxes"])
def test_image_outputs_pointing_at_folders_or_nonsense(tmp_path, capsys, flag):
    before = sorted(p.name for p in tmp_path.iterdir())
    args = ("--image", "demo", "--seed", "3") if flag == "--demo-out" else ("--image", "demo", "--seed", "3")
    one_line_error(*cli(capsys, "run", "--prompt", "hi", *args, flag, tmp_path)[::2], f"{flag} {tmp_path} is a folder")
    one_line_error(*cli(capsys, "run", "--prompt", "hi", *args, flag, tmp_path / "x.notanimage")[::2],
                   "no image extension")
    one_line_error(*cli(capsys, "run", "--prompt", "hi", *args, flag, tmp_path / "missing" / "x.png")[::2],
                   "does not exist")
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_prompt_with_invalid_unicode(pkg, capsys):
    """A byte that is not UTF-8 on the command line arrives as a lone surrogate (surrogateescape)."""
    one_line_error(*run(capsys, pkg, prompt="caf\udce9")[::2], "invalid Unicode")
    one_line_error(*run(capsys, pkg, "--raw", prompt="caf\udce9")[::2], "invalid Unicode")


def test_chat_and_serve_refuse_absurd_threads_before_loading(pkg, capsys):
    one_line_error(*cli(capsys, "chat", pkg, "--threads", "100000")[::2], "--threads must be between 1 and")
    one_line_error(*cli(capsys, "serve", pkg, "--threads", "100000", "--port", "0")[::2],
                   "--threads must be between 1 and")
    one_line_error(*cli(capsys, "serve", pkg, "--max-image-patches", "-5", "--port", "0")[::2],
                   "--max-image-patches must be between 4")


@pytest.mark.parametrize("flag, value, says", [("--max-tokens", "0", "--max-tokens must be a whole number >= 1"),
                                               ("--shutdown-grace", "-1", "--shutdown-grace must be >= 0 seconds"),
                                               ("--allow-origin", "localhost:3000", "--allow-origin takes an origin")])
def test_serve_refuses_absurd_limits_before_loading(capsys, tmp_path, flag, value, says):
    # a folder that is no package: the limit is refused before the model is even looked at
    one_line_error(*cli(capsys, "serve", tmp_path / "nothing", flag, value, "--port", "0")[::2], says)


def test_image_of_extreme_aspect_ratio(capsys, tmp_path):
    Image.fromarray(np.zeros((1, 100000, 3), np.uint8)).save(tmp_path / "line.png")
    one_line_error(*cli(capsys, "run", "--prompt", "hi", "--image", tmp_path / "line.png")[::2], "cannot be fitted")


def test_min_p_one_keeps_only_the_likeliest_token(pkg, capsys):
    """--min-p reaches the sampler: at 1 only the likeliest tokens keep mass, so a hot sampled
    answer is the greedy one (without it the same seed samples another)."""
    code, greedy, err = run(capsys, pkg, "--temperature", "0", "--raw")
    assert code == 0, err
    code, hot, err = run(capsys, pkg, "--temperature", "5", "--seed", "3", "--raw")
    assert code == 0 and hot != greedy, err
    code, out, err = run(capsys, pkg, "--temperature", "5", "--seed", "3", "--min-p", "1", "--raw")
    assert code == 0 and out == greedy, err
