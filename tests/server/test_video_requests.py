"""Hostile video_url parts: frames symlinked out of the allowed folder (also swapped in after the
header was read), FIFOs, decompression bombs and damaged clips, absurd ``video_options``,
``file://`` URLs naming a host, folders of frames with any names, raw MPEG streams; and the
temporary files of data: URLs, gone when the request ends and never left behind by a SIGKILL.
Every refusal is a 400 (403 outside the folder) in one line, at once."""

import base64
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest
from PIL import Image

import edgevl
from edgevl.errors import EdgevlError
from edgevl.processing import video as vid
from edgevl.server import make_server
from support.clips import damaged_clips, has_pyav, save_animation, small_frames, write_gif, write_pyav
from support.qwen import make_qwen3_5
from support.server import post, send_raw, wait_for

PROMPT = "What happens in the video?"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("video-requests")
    ck = make_qwen3_5(root / "ck", seed=85)
    pk = edgevl.convert(ck, root / "pk", dtype="fp32", progress=False)
    allowed, outside = root / "allowed", root / "outside"
    allowed.mkdir()
    outside.mkdir()
    for k in range(4):
        Image.new("RGB", (64, 48), (50 * k, 0, 0)).save(outside / f"{k}.png")
        Image.new("RGB", (64, 48), (0, 50 * k, 0)).save(allowed / f"in{k}.png")
    save_animation(allowed / "clip.gif", small_frames(6, 64, 48))
    srv, _ = make_server(edgevl.load(pk), image_dir=allowed)
    yield srv, pk, allowed, outside
    srv.stop()


def ask(srv, url, timeout=60, **extra):
    return post(srv.server_address[1], {"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": PROMPT}]}],
        "max_tokens": 2, "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}, **extra},
        timeout=timeout)


def refused(reply, status, *needles):
    st, body, _ = reply
    assert st == status, (st, body)
    msg = body["error"]["message"]
    assert "\n" not in msg and all(n in msg for n in needles), (needles, msg)
    return msg


def data_url(path, mime="video/mp4"):
    return f"data:{mime};base64," + base64.b64encode(open(path, "rb").read()).decode()


# -- class 1: every file opened lies inside the allowed folder ---------------------------------

def test_frames_symlinked_out_of_the_allowed_folder_are_refused(setup):
    srv, _, allowed, outside = setup
    out = allowed / "out"
    out.mkdir()
    for k in range(4):               # each frame a symlink to a file outside
        (out / f"{k}.png").symlink_to(outside / f"{k}.png")
    mixed = allowed / "mixed"
    mixed.mkdir()
    for k in range(3):               # real frames, and a last one through a chain of links
        Image.new("RGB", (64, 48)).save(mixed / f"{k}.png")
    (allowed / "hop.png").symlink_to(outside / "3.png")
    (mixed / "3.png").symlink_to(allowed / "hop.png")
    inside = allowed / "inside"
    inside.mkdir()
    for k in range(4):               # links that stay inside are fine
        (inside / f"{k}.png").symlink_to(allowed / f"in{k}.png")
    for folder in ("out", "mixed", f"file://{allowed}/mixed"):
        msg = refused(ask(srv, folder), 403, "outside the allowed folder")
        assert str(outside) not in msg, msg
    assert ask(srv, "inside")[0] == 200


def test_a_url_naming_the_allowed_folder_itself_is_no_video(setup):
    """An empty url (or "." or "file://") named the allowed folder, and every image in it was
    taken as one clip, with a 200."""
    srv, _, allowed, _ = setup
    for url in ("", ".", "file://", f"file://{allowed}", f"{allowed}/", "in0.png/.."):
        refused(ask(srv, url), 400, "messages[0].content[0].video_url.url names no video",
                "give a video file or a folder of frames inside it")
    assert ask(srv, "clip.gif")[0] == 200


def test_a_frame_swapped_for_a_symlink_after_the_header_is_refused_where_it_is_opened(setup):
    _, _, allowed, outside = setup
    folder = allowed / "swap"
    folder.mkdir()
    for k in range(4):
        Image.new("RGB", (64, 48)).save(folder / f"{k}.png")
    clip = vid.open_clip(vid.VideoFile(folder, root=allowed, name="swap"))
    (folder / "2.png").unlink()
    (folder / "2.png").symlink_to(outside / "2.png")
    with pytest.raises(EdgevlError, match="outside the allowed folder") as e:
        list(clip.read([0, 1, 2, 3]))
    assert str(outside) not in str(e.value)


def test_an_image_swapped_for_a_symlink_while_the_request_waits_is_refused(setup):
    """An image path is checked when the request arrives and opened when it holds the model: a
    symlink to a file outside, swapped in between, must not be read."""
    from edgevl.server import HTTPError, _image

    srv, _, allowed, outside = setup
    Image.new("RGB", (64, 48), (9, 9, 9)).save(allowed / "later.png")
    pending = _image("later.png", srv, "messages[0].content[0].image_url")
    (allowed / "later.png").unlink()
    (allowed / "later.png").symlink_to(outside / "1.png")   # the same size: no other check notices
    with pytest.raises(HTTPError) as e:
        pending.decode()
    assert e.value.status == 403 and "outside the allowed folder" in str(e.value), e.value
    assert str(outside) not in str(e.value)
    (allowed / "later.png").unlink()
    Image.new("RGB", (64, 48), (9, 9, 9)).save(allowed / "later.png")
    assert _image("later.png", srv, "x").decode().getpixel((0, 0)) == (9, 9, 9)


def test_a_playlist_cannot_open_files_it_names(setup, tmp_path):
    """An HLS playlist or an FFmpeg concat list inside the allowed folder naming a clip outside
    it: FFmpeg would open that clip (at any depth); no file but the one given is ever opened."""
    if not has_pyav():
        pytest.skip("PyAV is the optional video extra")
    srv, _, allowed, outside = setup
    seg = write_pyav(outside / "seg.ts", small_frames(10, 64, 48), codec="mpeg2video", rate=10, fmt="mpegts")
    (allowed / "list.m3u8").write_text(f"#EXTM3U\n#EXT-X-TARGETDURATION:2\n#EXTINF:1.0,\n{seg}\n#EXT-X-ENDLIST\n")
    (allowed / "list.ffconcat").write_text(f"ffconcat version 1.0\nfile {seg}\n")
    for name in ("list.m3u8", "list.ffconcat"):
        for url in (name, data_url(allowed / name, "application/vnd.apple.mpegurl")):
            msg = refused(ask(srv, url), 400)
            assert re.search("cannot be read as a video|names other files", msg) and str(outside) not in msg, msg


# -- class 3: non-regular files -----------------------------------------------------------------

def test_fifos_answer_at_once(setup):
    srv, _, allowed, _ = setup
    fifo = allowed / "pipe.mp4"
    os.mkfifo(fifo)
    frames = allowed / "fifo-frames"
    frames.mkdir()
    for k in range(3):
        Image.new("RGB", (64, 48)).save(frames / f"{k}.png")
    os.mkfifo(frames / "3.png")
    try:
        for url in ("pipe.mp4", "fifo-frames"):
            t = time.perf_counter()
            refused(ask(srv, url, timeout=15), 400, "not a regular file")
            assert time.perf_counter() - t < 5
    finally:
        for f in (fifo, frames / "3.png"):
            try:        # a reader stuck on it (the old code) gets end-of-file
                os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass


# -- classes 4, 6: bombs and damaged clips ----------------------------------------------------------

def test_bombs_and_damaged_clips_answer_400_in_one_line(setup, tmp_path):
    srv = setup[0]
    for name, (path, needle) in damaged_clips(tmp_path, pyav=has_pyav()).items():
        msg = refused(ask(srv, data_url(path)), 400, needle, "the video")
        assert str(tmp_path) not in msg and tempfile.gettempdir() not in msg, (name, msg)


def test_a_clip_that_fails_while_decoded_is_named_as_the_responses_request_named_it(setup, tmp_path):
    """A clip whose header reads but whose frames do not was named messages[0].content[0] (the chat
    reading's name) in the Responses API, where the request called it input[0].content[0]."""
    import av

    srv = setup[0]
    whole = tmp_path / "whole.mp4"       # its index first (faststart): cut in half, the header still reads
    with av.open(str(whole), "w", options={"movflags": "faststart"}) as c:
        s = c.add_stream("mpeg4", rate=8)
        s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        for f in small_frames(120, 64, 48):
            for pkt in s.encode(av.VideoFrame.from_ndarray(np.asarray(f), format="rgb24")):
                c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(whole.read_bytes()[:whole.stat().st_size // 2])
    for path, needle in ((cut, "truncated"),):
        st, body, _ = post(srv.server_address[1], {"max_output_tokens": 2, "input": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": data_url(path)}}, {"type": "input_text", "text": PROMPT}]}]},
            path="/v1/responses")
        assert st == 400 and needle in body["error"]["message"], body
        assert body["error"]["param"] == "input[0].content[0]" and "messages" not in body["error"]["message"], body


# -- class 8: video_options ---------------------------------------------------------------------------

def test_video_options_are_checked_and_used(setup):
    srv, _, allowed, _ = setup
    for opts, needle in (({"fps": float("inf")}, "fps"), ({"fps": 1e308}, "fps"), ({"max_frames": 1e400}, "max_frames"),
                         ({"max_pixels": 0.5}, "max_pixels"), ({"fsp": 2}, "fsp"), ([1, 2], "video_options"),
                         ({"max_frames": "8"}, "max_frames")):
        st, body, _ = ask(srv, "clip.gif", video_options=opts)
        assert st == 400 and needle in body["error"]["message"] and body["error"]["param"] == "video_options", body
    few = ask(srv, "clip.gif", video_options={"max_frames": 2, "fps": 1})
    many = ask(srv, "clip.gif", video_options={"fps": 1000})
    assert few[0] == many[0] == 200
    assert few[1]["usage"]["prompt_tokens"] < many[1]["usage"]["prompt_tokens"]


# -- class 11: file URLs ---------------------------------------------------------------------------

def test_file_urls_naming_a_host_are_refused(setup):
    srv, _, allowed, _ = setup
    refused(ask(srv, f"file://otherhost{allowed}/clip.gif"), 400, "host")
    assert ask(srv, f"file://localhost{allowed}/clip.gif")[0] == 200
    assert ask(srv, f"file://{allowed}/clip.gif")[0] == 200


# -- classes 7, 10: any frame names, raw MPEG streams --------------------------------------------------

def test_mixed_frame_names_and_raw_mpeg(setup, tmp_path):
    srv, _, allowed, _ = setup
    folder = allowed / "named"
    folder.mkdir()
    for k, name in enumerate(("1.png", "2.png", "cover.png", "10.png")):
        Image.new("RGB", (64, 48), (40 * k, 0, 0)).save(folder / name)
    assert ask(srv, "named")[0] == 200
    if has_pyav():
        m1v = write_pyav(tmp_path / "clip.m1v", small_frames(10, 64, 48), codec="mpeg1video", rate=25,
                         fmt="mpeg1video")
        st, body, _ = ask(srv, data_url(m1v, "video/mpeg"))
        assert st == 200, body


# -- class 12: temporary files ------------------------------------------------------------------------

def _open_in(folder):
    """Descriptors of this process open on files in ``folder`` (deleted ones included)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(str(folder)):
                found.append(fd)
        except OSError:
            pass
    return found


def streaming(port, url):
    """A socket whose request streams its answer (greedy, up to thousands of tokens: tens of
    seconds on the tiny model), once the first event came."""
    s = send_raw(port, {"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": PROMPT}]}],
        "max_tokens": 4000, "temperature": 0, "stream": True, "chat_template_kwargs": {"enable_thinking": False}})
    s.settimeout(60)
    got = b""
    while b"data: " not in got:
        chunk = s.recv(4096)
        assert chunk, got
        got += chunk
    return s


def test_temporary_files_are_gone_when_the_request_ends(setup, tmp_path, monkeypatch):
    srv, _, allowed, _ = setup
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    url = data_url(allowed / "clip.gif", "image/gif")
    long_clip = data_url(write_gif(tmp_path / "long.gif", (1024, 1024), [(0, 0, 8, 8)] * 400), "image/gif")
    port = srv.server_address[1]

    def clean():    # the handler closes them as it finishes, just after the client has its answer
        return wait_for(lambda: not os.listdir(tmp) and not _open_in(tmp), 2) is not None

    assert ask(srv, url)[0] == 200 and clean()                                    # success
    st, body, _ = post(port, {"messages": [{"role": "user", "content": [           # refused after storing it
        {"type": "video_url", "video_url": {"url": url}}, {"type": "bogus"}]}]})
    assert st == 400 and clean(), body
    st, body, _ = ask(srv, long_clip, video_options={"max_pixels": 10 ** 9})      # over the context
    assert st == 400 and "context" in body["error"]["message"] and clean(), body
    s = streaming(port, url)                                                       # a client that hangs up
    s.close()
    assert wait_for(lambda: not srv.gate.locked(), 10) is not None
    assert clean(), (os.listdir(tmp), _open_in(tmp))


def test_sigkill_of_the_server_leaves_no_temporary_file(setup, tmp_path):
    _, pk, allowed, _ = setup
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "edgevl", "serve", str(pk), "--port", "0", "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "TMPDIR": str(tmp)})
    try:
        port = int(re.search(r"127\.0\.0\.1:(\d+)", proc.stdout.readline()).group(1))
        s = streaming(port, data_url(allowed / "clip.gif", "image/gif"))    # the clip is held meanwhile
        during = os.listdir(tmp)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        s.close()
    finally:
        proc.kill()
        proc.wait()
    assert during == [] and os.listdir(tmp) == [], (during, os.listdir(tmp))


# -- class 6: a clip is decoded on the request's own thread --------------------------------------

def _video_part(url):
    return [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": PROMPT}]


def test_a_clip_being_decoded_does_not_stall_the_other_requests(setup, monkeypatch, tmp_path):
    """Decoding a clip (a long one, or a bomb of frames) happens off the model's thread: while one
    request's clip decodes, another request is answered."""
    srv = setup[0]
    clip = save_animation(tmp_path / "c.gif", small_frames(9, 64, 48))   # bytes no other test sends: not cached
    entered, release = threading.Event(), threading.Event()
    real = vid.load_video

    def slow(*a, **kw):
        entered.set()
        release.wait(60)
        return real(*a, **kw)

    monkeypatch.setattr(vid, "load_video", slow)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("video", ask(srv, data_url(clip, "image/gif"), timeout=120)))
    t.start()
    try:
        assert entered.wait(30)
        status, body, _ = post(srv.server_address[1], {"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 2}, timeout=30)
        assert status == 200 and not out, body      # answered while the clip still decodes
    finally:
        release.set()
        t.join(120)
    assert out["video"][0] == 200, out


def test_a_client_that_hangs_up_while_its_clip_decodes_frees_its_slot(setup, monkeypatch, tmp_path):
    srv = setup[0]
    clip = save_animation(tmp_path / "c.gif", small_frames(10, 64, 48))
    entered = threading.Event()

    def endless(*a, **kw):       # decodes frame after frame, as a bomb of frames would
        entered.set()
        for _ in range(6000):
            vid._check_caller()
            time.sleep(0.01)
        raise AssertionError("decoding went on after the client hung up")

    monkeypatch.setattr(vid, "load_video", endless)
    s = send_raw(srv.server_address[1], {"messages": [{"role": "user", "content": _video_part(
        data_url(clip, "image/gif"))}], "max_tokens": 2})
    assert entered.wait(30)
    s.close()
    took = wait_for(lambda: not srv.gate.locked(), 10)
    assert took is not None and took < 3, took


def test_decoding_stops_between_frames_once_the_caller_is_gone(tmp_path):
    """Reaching one sampled frame may take thousands of decoded ones: the caller is asked after each."""
    path = save_animation(tmp_path / "long.gif", small_frames(40, 64, 48))
    asked = []
    with vid.cancel_when(lambda: asked.append(1) or len(asked) >= 5), pytest.raises(vid.DecodeCancelled):
        vid.load_video(path, vid.VideoConfig(), max_frames=2)   # frames 0 and 39: all 40 decoded
    assert len(asked) == 5
    assert len(vid.load_video(path, vid.VideoConfig(), max_frames=2).frames) == 2   # no caller: as before
    if has_pyav():
        clip = write_pyav(tmp_path / "long.mp4", small_frames(40, 64, 48))
        asked.clear()
        with vid.cancel_when(lambda: asked.append(1) or len(asked) >= 5), pytest.raises(vid.DecodeCancelled):
            vid.load_video(clip, vid.VideoConfig(), max_frames=2)
        assert len(asked) == 5


def test_a_clip_that_would_take_too_long_to_decode_is_refused_from_its_header(setup, tmp_path):
    """A 30 KB GIF of 2000 one-pixel frames on a 2048x2048 canvas: Pillow composes every frame onto
    the whole canvas, ~0.1 s each, and sampling its last frame decodes them all. Refused at once,
    from the header; a server given a larger --max-video-decode takes it."""
    srv = setup[0]
    bomb = write_gif(tmp_path / "bomb.gif", (2048, 2048), [(k % 2048, 0, 1, 1) for k in range(2000)])
    t0 = time.monotonic()
    msg = refused(ask(srv, data_url(bomb, "image/gif"), video_options={"max_frames": 2}), 400,
                  "decoding 2000 frames of 2048x2048 composed on the whole canvas", "64 gigapixels")
    assert time.monotonic() - t0 < 20, msg
    plain = save_animation(tmp_path / "ok.gif", small_frames(6, 64, 48))
    assert ask(srv, data_url(plain, "image/gif"))[0] == 200
    with pytest.raises(EdgevlError, match="--max-video-decode must be a number of gigapixels > 0"):
        make_server(srv.model, max_video_decode=0)


def test_a_frame_folder_counts_only_its_sampled_frames():
    clip = vid.Clip(10_000, 30.0, 1920, 1080, None, "frames", "sampled")
    assert vid.decode_work(clip, [0, 9_999]) == 2 * 1920 * 1080
    clip.decodes = "file"
    assert vid.decode_work(clip, [0, 9_999]) == 10_000 * 1920 * 1080
