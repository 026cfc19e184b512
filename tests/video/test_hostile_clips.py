"""Hostile and damaged clips through the processor, the API, ``run``, ``chat`` (``--video`` and
``/video``) and ``batch``: decompression bombs refused from their headers, damaged files at any
cut or flipped byte, FIFOs and devices, frame folders with any mix of names, absurd options and
absurd frame rates, clips over the context refused before anything is decoded, raw MPEG streams,
frames given as arrays, and the memory a header read may take whatever the file claims. Each is
one line naming the file and the fix (exit 2 in the CLI, a row error in batch); a chat keeps its
conversation. The server's side is tests/server/test_video_requests.py."""

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from PIL import Image

import edgevl
from edgevl.chat import ChatSession, chat_loop
from edgevl.errors import EdgevlError
from edgevl.generate import prepare
from edgevl.processing import video as vid
from support.cli import cli, one_line_error
from support.clips import damaged_clips, gif_bytes, has_pyav, save_animation, small_frames, write_gif, write_pyav
from support.common import TESTS
from support.files import edit_json, png_bomb
from support.qwen import make_qwen3_5

PROMPT = "What happens in the video?"
CFG = vid.VideoConfig()
FAST = dict(max_new_tokens=2, temperature=0, thinking=False)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-clips")
    ck = make_qwen3_5(root / "ck", seed=83)
    # the released checkpoints' pixel budget (the tiny one's 65536 pixels keep any clip small)
    edit_json(ck / "video_preprocessor_config.json", lambda d: d["size"].update(longest_edge=25165824))
    pk = edgevl.convert(ck, root / "pk", dtype="fp32", progress=False)
    return pk, edgevl.load(pk), root


@pytest.fixture(scope="module")
def bad(setup):
    return damaged_clips(setup[2] / "bad", pyav=has_pyav())


def refused(fn, *needles):
    """fn() raises EdgevlError in one line holding every needle; returns the message."""
    with pytest.raises(EdgevlError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in needles), (needles, msg)
    return msg


class Out:
    def __init__(self):
        self.said = []

    def write(self, s):
        self.said.append(s)

    def flush(self):
        pass

    @property
    def lines(self):
        return "".join(self.said).splitlines()


def chat(model, lines, **kw):
    out, feed = Out(), iter(lines)
    model.reset()
    code = chat_loop(model, input_fn=lambda _: next(feed), out=out, max_new_tokens=2, temperature=0,
                     thinking=False, **kw)
    return code, out.lines


# -- bombs and damaged files (classes 4 and 6) ---------------------------------------------------

def test_bombs_and_damaged_files_through_the_api_and_run(setup, bad, capsys):
    pk, model, _ = setup
    for path, needle in bad.values():
        refused(lambda p=path: vid.load_video(p, CFG), needle, path)
        refused(lambda p=path: edgevl.generate(model, PROMPT, video=p, **FAST), needle, path)
        code, _, err = cli(capsys, "run", pk, "--prompt", PROMPT, "--video", path, "--max-new-tokens", 2)
        one_line_error(code, err, needle, path)
        code, _, err = cli(capsys, "chat", pk, "--video", path)
        one_line_error(code, err, needle, path)


def test_video_command_in_a_chat_prints_one_line_and_keeps_the_conversation(setup, bad, tmp_path):
    _, model, _ = setup
    paths = [p for p, _ in bad.values()]
    saved = tmp_path / "chat.json"
    code, lines = chat(model, ["Hello.", *[f"/video {p}" for p in paths], "And now?", f"/save {saved}", "/quit"])
    assert code == 0
    said = [m["content"] for m in json.loads(saved.read_text())["messages"] if m["role"] == "user"]
    assert said == ["Hello.", "And now?"]          # both turns kept, no video attached by a refusal
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == len(paths), lines
    for (path, needle), line in zip(bad.values(), errors):
        assert needle in line and path in line, line


def test_batch_rows_name_the_damage_in_one_line(setup, bad, tmp_path, capsys):
    pk, _, _ = setup
    table = tmp_path / "jobs.jsonl"
    table.write_text("".join(json.dumps({"id": k, "video": p}) + "\n" for k, (p, _) in bad.items()))
    out = tmp_path / "out.jsonl"
    cli(capsys, "batch", pk, "--input", table, "--prompt", PROMPT, "--output", out, "--max-new-tokens", 2,
        "--threads", 1, "--quiet", "--no-thinking")
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    for name, (path, needle) in bad.items():
        err = rows[name]["error"]
        assert err and needle in err and path in err and "\n" not in err, (name, err)
        assert not err.split(":")[0].endswith("Error"), err     # no raw exception


@pytest.mark.parametrize("kind", ["gif", "png", "webp", "mp4", "webm"])
def test_any_cut_or_flipped_byte_is_a_clip_or_one_line(tmp_path, kind):
    """Every prefix and every flipped byte (sampled through the file) of a small clip: it loads, or
    it is an EdgevlError in one line naming the file; never another exception."""
    if kind in ("mp4", "webm") and not has_pyav():
        pytest.skip("PyAV is the optional video extra")
    frames = small_frames(6, 32, 24)
    whole = tmp_path / f"whole.{kind}"
    if kind in ("mp4", "webm"):
        write_pyav(whole, frames, codec="mpeg4" if kind == "mp4" else "libvpx-vp9")
    else:
        save_animation(whole, frames)
    data = whole.read_bytes()
    path = tmp_path / f"x.{kind}"
    others = []
    for at in sorted(set(np.linspace(0, len(data) - 1, 80).astype(int).tolist())):
        for damaged in (data[:at], data[:at] + bytes([data[at] ^ 0x5A]) + data[at + 1:]):
            path.write_bytes(damaged)
            try:
                vid.load_video(str(path), CFG)
            except EdgevlError as e:
                assert "\n" not in str(e) and str(path) in str(e), str(e)
            except Exception as e:  # noqa: BLE001 - the failure this test looks for
                others.append(f"{'cut' if len(damaged) == at else 'flip'}@{at}: {type(e).__name__}: {e}")
    assert not others, others[:5]


def test_an_mp4_cut_in_half_says_it_may_be_cut_short(tmp_path):
    """What an interrupted download of an MP4 looks like (its index is written last): the error
    points at a file cut short, not only at a missing video stream."""
    if not has_pyav():
        pytest.skip("PyAV is the optional video extra")
    whole = tmp_path / "whole.mp4"
    write_pyav(whole, [np.full((64, 64, 3), i * 20, np.uint8) for i in range(8)], rate=4)   # the index past half
    half = tmp_path / "half.mp4"
    half.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    with pytest.raises(EdgevlError, match="a file cut short"):
        vid.load_video(str(half), CFG)


# -- non-regular files (class 3) ------------------------------------------------------------------

def _within(seconds, fn):
    """fn()'s exception or result, or "blocked" when it did not return in time."""
    box = []

    def run():
        try:
            box.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    return box[0] if box else "blocked"


def _unblock(fifo):
    try:  # a reader stuck on the FIFO gets end-of-file
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def test_fifos_and_devices_are_refused_without_blocking(setup, tmp_path, capsys):
    pk, model, _ = setup
    fifo = tmp_path / "pipe.mp4"
    os.mkfifo(fifo)
    frames = tmp_path / "frames"
    frames.mkdir()
    for i in range(3):
        Image.new("RGB", (64, 64), (40 * i, 0, 0)).save(frames / f"{i}.png")
    os.mkfifo(frames / "3.png")
    try:
        for video in (str(fifo), "/dev/zero", str(frames)):
            for fn in (lambda v=video: vid.load_video(v, CFG),
                       lambda v=video: edgevl.generate(model, PROMPT, video=v, **FAST)):
                got = _within(10, fn)
                assert isinstance(got, EdgevlError), (video, got)
                assert "not a regular file" in str(got) and "\n" not in str(got), str(got)
        got = _within(10, lambda: cli(capsys, "run", pk, "--prompt", PROMPT, "--video", fifo, "--max-new-tokens", 2))
        one_line_error(got[0], got[2], "not a regular file", str(fifo))
        got = _within(10, lambda: chat(model, [f"/video {fifo}", f"/video {frames}", "/quit"]))
        assert got[0] == 0 and sum("not a regular file" in line for line in got[1]) == 2, got
        table = tmp_path / "t.jsonl"
        table.write_text(json.dumps({"id": "fifo", "video": str(fifo)}) + "\n")
        _within(20, lambda: cli(capsys, "batch", pk, "--input", table, "--prompt", PROMPT, "--output",
                                tmp_path / "o.jsonl", "--max-new-tokens", 2, "--threads", 1, "--quiet"))
        assert "not a regular file" in json.loads((tmp_path / "o.jsonl").read_text())["error"]
    finally:
        _unblock(fifo)
        _unblock(frames / "3.png")


# -- memory of a header read (class 5) ------------------------------------------------------------

MEMORY = """
import resource, sys
from edgevl.errors import EdgevlError
from edgevl.processing import video as vid
def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
before = peak()
clip = vid.open_clip(sys.argv[1])
vid.plan(clip, vid.VideoConfig())
header = peak() - before
try:
    vid.load_video(sys.argv[2], vid.VideoConfig())
    refused = "no"
except EdgevlError as e:
    refused = "yes" if "8000x8000" in str(e) else str(e)
print(clip.total, header, peak() - before, refused)
"""


def test_a_gif_on_a_huge_screen_costs_no_memory_to_read_or_refuse(tmp_path):
    """18 kB claiming 64 frames on a 4096x4096 logical screen: counting its frames and reading
    their durations composited each onto the whole screen (~230 MB and 5 s here; an 8000x8000
    screen took ~550 MB and 13 s). The header read now walks the blocks. The same on an 8000x8000
    screen, decoded, held about four screens (800 MB, 30 s): now refused from its header. Measured
    in a fresh process: the peak RSS added by each."""
    frames = [(8 * (k % 50), 0, 8, 8) for k in range(64)]
    gif = write_gif(tmp_path / "screen.gif", (4096, 4096), frames)
    huge = write_gif(tmp_path / "huge.gif", (8000, 8000), frames)
    r = subprocess.run([sys.executable, "-c", MEMORY, gif, huge], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(TESTS.parent)})
    assert r.returncode == 0, r.stderr
    total, header_mb, decode_mb, refused = r.stdout.split()
    print(f"\nGIF of 64 frames on a 4096x4096 screen: header read +{header_mb} MB peak RSS; on an 8000x8000 "
          f"screen, decoding: +{decode_mb} MB, refused: {refused}")
    assert total == "64" and int(header_mb) < 30 and int(decode_mb) < 30 and refused == "yes"


def test_gif_header_reads_what_pillow_decodes(tmp_path):
    """Frame count, durations and canvas from the block walk equal Pillow's, on GIFs with and
    without delays, with a missing trailer, stray block terminators and a frame beyond the screen."""
    cases = {"plain": gif_bytes((40, 30), [(0, 0, 40, 30)] * 5, delay_cs=7),
             "no-delay": gif_bytes((40, 30), [(0, 0, 40, 30)] * 3, delay_cs=None),
             "no-trailer": gif_bytes((40, 30), [(0, 0, 40, 30)] * 4, trailer=False),
             "grows": gif_bytes((40, 30), [(10, 10, 40, 30)] * 4)}
    cases["stray-zero"] = cases["plain"][:-1] + b"\x00\x00;"
    for name, data in cases.items():
        path = tmp_path / f"{name}.gif"
        path.write_bytes(data)
        clip = vid.open_clip(str(path))
        with Image.open(path) as im:
            want_size, n = im.size, im.n_frames
            durations = []
            for i in range(n):
                im.seek(i)
                durations.append(im.info.get("duration") or 0)
        mean = sum(durations) / n
        assert (clip.total, (clip.width, clip.height)) == (n, want_size), name
        assert clip.fps == (1000 / mean if mean else None), name
        got = [np.asarray(f) for _, f in clip.read(list(range(n)))]
        assert len(got) == n and got[0].shape == (want_size[1], want_size[0], 3), name


# -- frame folders with any names (class 7) -------------------------------------------------------

NAMES = ["10.png", "2.png", "1.png", "cover.png", "a10.png", "a2.png", "a02.png", "_.png", "B.png", "٣.png",
         "1a.png", "x1y2.png"]


def test_frame_folders_with_any_mix_of_names_sort_deterministically(setup, tmp_path, capsys):
    pk, model, _ = setup
    folder = tmp_path / "mixed"
    folder.mkdir()
    for k, name in enumerate(NAMES):
        Image.new("RGB", (64, 48), (20 * k, 0, 0)).save(folder / name)
    clip = vid.open_clip(str(folder))
    order = [int(np.asarray(im)[0, 0, 0]) // 20 for _, im in clip.read(list(range(clip.total)))]
    named = [NAMES[k] for k in order]
    assert named[:5] == ["1.png", "1a.png", "2.png", "٣.png", "10.png"], named
    assert named.index("a2.png") < named.index("a10.png") and len(set(named)) == len(NAMES)
    assert edgevl.generate(model, PROMPT, video=str(folder), **FAST) is not None
    code, _, err = cli(capsys, "run", pk, "--prompt", PROMPT, "--video", folder, "--max-new-tokens", 2)
    assert code == 0, err
    code, lines = chat(model, [f"/video {folder}", "/quit"])
    assert code == 0 and not any(line.startswith("error: ") for line in lines), lines
    table = tmp_path / "t.jsonl"
    table.write_text(json.dumps({"id": "mixed", "video": str(folder)}) + "\n")
    cli(capsys, "batch", pk, "--input", table, "--prompt", PROMPT, "--output", tmp_path / "o.jsonl",
        "--max-new-tokens", 2, "--threads", 1, "--quiet", "--no-thinking")
    assert json.loads((tmp_path / "o.jsonl").read_text())["error"] is None


def test_frame_folders_with_huge_frames_are_refused_from_their_headers(tmp_path, capsys):
    """A huge frame (first or later) is refused before it is decoded, in one line and with no
    warning printed: a later one by its size differing from the first's."""
    first, later = tmp_path / "first", tmp_path / "later"
    for folder in (first, later):
        folder.mkdir()
        for k in range(1, 4):
            Image.new("RGB", (64, 48)).save(folder / f"{k}.png")
    png_bomb(first / "0.png", 20000, 20000)
    png_bomb(later / "2b.png", 10000, 10000)      # between Pillow's warning and its error
    refused(lambda: vid.load_video(str(first), CFG), "0.png", "outside what is accepted")
    refused(lambda: vid.load_video(str(later), CFG), "2b.png", "differ in size")
    assert capsys.readouterr().err == ""


# -- absurd options and frame rates (class 8) ------------------------------------------------------

BAD_OPTIONS = [({"fps": float("inf")}, "fps"), ({"fps": 1e308}, "fps"), ({"max_frames": float("inf")}, "max_frames"),
               ({"max_pixels": float("inf")}, "max_pixels"), ({"max_pixels": 0.5}, "max_pixels"),
               ({"max_frames": 2.5}, "max_frames"), ({"fps": "2"}, "fps"), ({"fsp": 2}, "fsp"),
               ([("fps", 2)], "video_options"), ({"max_pixels": True}, "max_pixels")]


def test_absurd_video_options_are_one_line(setup, tmp_path, capsys):
    pk, model, _ = setup
    gif = save_animation(tmp_path / "clip.gif", small_frames(60, 64, 48))
    for opts, needle in BAD_OPTIONS:
        refused(lambda o=opts: edgevl.generate(model, PROMPT, video=gif, video_options=o, **FAST), needle)
        refused(lambda o=opts: ChatSession(model, video_options=o), needle)
    for args, needle in ((["--fps", "1e308"], "--fps"), (["--fps", "inf"], "--fps"),
                         (["--video-max-pixels", "1e9"], "--video-max-pixels")):
        one_line_error(*cli(capsys, "run", pk, "--prompt", PROMPT, "--video", gif, *args)[::2], needle)
        one_line_error(*cli(capsys, "chat", pk, "--video", gif, *args)[::2], needle)
    # the largest sensible values work
    assert edgevl.generate(model, PROMPT, video=gif, video_options={"fps": 1000, "max_frames": 10 ** 12,
                                                                     "max_pixels": 10 ** 12}, **FAST) is not None


def test_absurd_frame_rates(tmp_path):
    frames = small_frames(8, 32, 32)
    for fps in (float("inf"), float("nan"), 1e308, -1, 0, "24"):
        refused(lambda f=fps: vid.load_video({"frames": frames, "fps": f}, CFG), "fps")
    refused(lambda: vid.load_video({"frames": frames, "fps": 2, "fsp": 3}, CFG), "fsp")
    # a file claiming an absurd rate (here 65535 fps, from 1/65535 s delays) counts as one without a
    # rate (24 fps, transformers' assumption), not as "every frame at 0.0 s"
    apng = save_animation(tmp_path / "fast.png", frames, duration=1000 / 65535)
    with Image.open(apng) as im:
        assert round(im.info["duration"], 4) == round(1000 / 65535, 4)
    s = vid.load_video(apng, CFG, fps=24)
    assert s.source_fps is None and s.timestamps == vid.timestamps(s.indices, None, 2)
    assert s.timestamps[-1] > 0
    # a rate too slow to be real is taken at its word: over 4 hours is refused
    slow = save_animation(tmp_path / "slow.png", frames, duration=65535 * 1000)
    refused(lambda: vid.load_video(slow, CFG), "hours", slow)


# -- clips over the context are refused before decoding (class 9) -------------------------------

def test_over_context_clips_are_refused_before_decoding(setup, tmp_path, capsys, monkeypatch):
    """A clip whose tokens cannot fit: the API, run, chat (--video and /video) and a batch row
    refuse it from its header, saying how to make it fit; nothing is decoded (decoding and encoding
    a 1280x720 clip at 30 fps took 14 s and 1.2 GB before its refusal)."""
    pk, model, _ = setup
    gif = write_gif(tmp_path / "long.gif", (640, 480), [(0, 0, 8, 8)] * 200)     # 20 s on a 640x480 screen
    assert model.vision.video_tokens(gif) > model.max_context          # the premise: this clip cannot fit

    def no_decoding(*a, **k):
        raise AssertionError("the clip was decoded before it was refused")

    monkeypatch.setattr(vid, "load_video", no_decoding)
    needles = ("video", "--fps", "--max-frames", "--video-max-pixels")
    msg = refused(lambda: edgevl.generate(model, PROMPT, video=gif, **FAST), *needles)
    assert "image" not in msg
    one_line_error(*cli(capsys, "run", pk, "--prompt", PROMPT, "--video", gif)[::2], *needles)
    one_line_error(*cli(capsys, "chat", pk, "--video", gif)[::2], *needles)
    code, lines = chat(model, [f"/video {gif}", "/quit"])
    assert code == 0 and sum(line.startswith("error: ") and "--fps" in line for line in lines) == 1, lines
    table = tmp_path / "t.jsonl"
    table.write_text(json.dumps({"id": "long", "video": gif}) + "\n")
    cli(capsys, "batch", pk, "--input", table, "--prompt", PROMPT, "--output", tmp_path / "o.jsonl",
        "--max-new-tokens", 2, "--threads", 1, "--quiet", "--no-thinking")
    err = json.loads((tmp_path / "o.jsonl").read_text())["error"]
    assert err and all(n in err for n in needles), err
    # the count in the message is the header's, and it is the prompt's: the clip sampled sparsely fits
    assert f"takes {model.video_tokens(gif)} tokens" in msg
    monkeypatch.undo()
    grown = len(prepare(model, PROMPT, video=gif, video_options={"fps": 0.25}).input_ids) - len(
        prepare(model, PROMPT).input_ids)
    assert abs(grown - model.video_tokens(gif, fps=0.25)) <= 2


def test_a_clip_that_fits_only_without_the_text_is_refused_before_decoding(setup, tmp_path, monkeypatch):
    """The prompt's text counts too: a clip that fits the context alone but not beside a long
    question is refused from its header, not after decoding."""
    pk, model, _ = setup
    gif = write_gif(tmp_path / "long.gif", (640, 480), [(0, 0, 8, 8)] * 200)
    fps = next(f for f in (2.0, 1.0, 0.5, 0.25) if model.video_tokens(gif, fps=f) < model.max_context)
    room = model.max_context - model.video_tokens(gif, fps=fps)
    long_prompt = " ".join(["frame"] * (room + 8))
    assert len(model.tokenizer.encode(long_prompt)) >= room     # the premise: text + clip overflow

    def no_decoding(*a, **k):
        raise AssertionError("the clip was decoded before it was refused")

    monkeypatch.setattr(vid, "load_video", no_decoding)
    msg = refused(lambda: edgevl.generate(model, long_prompt, video=gif, video_options={"fps": fps}, **FAST),
                  "video", "rest of the prompt")
    assert "image" not in msg


# -- raw MPEG streams (class 10) ------------------------------------------------------------------

@pytest.mark.parametrize("codec,ext", [("mpeg1video", "m1v"), ("mpeg2video", "m2v")])
def test_raw_mpeg_streams_go_to_pyav(setup, tmp_path, capsys, codec, ext):
    pytest.importorskip("av", reason="PyAV is the optional video extra; the test extra installs it")
    pk, model, _ = setup
    frames = [Image.new("RGB", (64, 48), (6 * i, 0, 0)) for i in range(12)]
    path = write_pyav(tmp_path / f"clip.{ext}", frames, codec=codec, rate=25, fmt=codec)
    clip = vid.open_clip(path)
    assert (clip.total, clip.width, clip.height) == (12, 64, 48)
    s = vid.load_video(path, CFG)
    assert len(s.frames) == 4 and s.source_fps == 25.0
    assert edgevl.generate(model, PROMPT, video=path, **FAST) is not None
    code, _, err = cli(capsys, "run", pk, "--prompt", PROMPT, "--video", path, "--max-new-tokens", 2, "-v")
    assert code == 0 and "[video 1: 4 frames sampled (25 fps source)" in err, err


# -- frames as arrays (class 13b) -----------------------------------------------------------------

def test_a_list_of_arrays_or_images_is_one_clip(setup):
    _, model, _ = setup
    arrays = [np.asarray(f) for f in small_frames(6, 64, 48)]
    want = edgevl.generate(model, PROMPT, video={"frames": arrays}, **FAST)
    assert edgevl.generate(model, PROMPT, video=arrays, **FAST) == want
    assert edgevl.generate(model, PROMPT, video=[Image.fromarray(a) for a in arrays], **FAST) == want
    assert edgevl.generate(model, PROMPT, video=np.stack(arrays), **FAST) == want
    two = edgevl.generate(model, PROMPT, video=[arrays, {"frames": arrays}], **FAST)
    assert isinstance(two, str)
    msg = refused(lambda: edgevl.generate(model, PROMPT, video=[np.zeros((4, 4), np.float32)] * 4, **FAST),
                  "uint8 [height, width, 3]")
    assert "frame 1" in msg
    refused(lambda: edgevl.generate(model, PROMPT, video=3.5, **FAST), "list of frames", "float")


@pytest.mark.skipif(not has_pyav(), reason="PyAV is a dependency of the test extra; CI has it")
@pytest.mark.parametrize("rotation", [-90, 90, 180])
def test_a_clip_stored_on_its_side_is_sampled_upright(tmp_path, rotation):
    """Phones store portrait video on its side with a display matrix; players turn it upright, and
    so does the clip reader (the size it plans with and every frame)."""
    frame = np.zeros((48, 96, 3), np.uint8)
    frame[:, :24] = 255                                     # the left quarter white, as stored
    path = write_pyav(tmp_path / "side.mp4", [frame] * 4, rotation=rotation)
    clip = vid.open_clip(path)
    img = np.asarray(next(iter(clip.read([0])))[1].convert("L"), np.float32)
    want = np.asarray(Image.fromarray(frame).rotate(rotation, expand=True).convert("L"), np.float32)
    assert (clip.width, clip.height) == (want.shape[1], want.shape[0]) == (img.shape[1], img.shape[0])
    assert np.abs(img - want).mean() < 12, np.abs(img - want).mean()   # mpeg4's loss only
