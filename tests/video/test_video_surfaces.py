"""Video through every surface: ``run --video``, ``chat`` (``--video`` and ``/video``), the server's
``video_url`` parts (base64 data: URLs) and a batch table's ``video`` column each give the answer
``edgevl.generate`` gives for that clip; bad clips, options and models without video are refused
in one line (HTTP 400 in the server, a row error in batch)."""

import base64
import json

import pytest

import edgevl
from edgevl.chat import chat_loop
from edgevl.demo import demo_package
from edgevl.errors import EdgevlError
from edgevl.server import make_server
from support.cli import cli, one_line_error
from support.common import smooth_image
from support.qwen import make_qwen3_5
from support.server import post

PROMPT = "What happens in the video?"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("video-surfaces")
    ck = make_qwen3_5(root / "ck", seed=81)
    pk = edgevl.convert(ck, root / "pk", dtype="fp32", progress=False)
    frames = [smooth_image(120, 60, 8).crop((4 * i, 0, 4 * i + 92, 60)) for i in range(9)]
    gif = root / "clip.gif"
    frames[0].save(gif, save_all=True, append_images=frames[1:], duration=200, loop=0)
    model = edgevl.load(pk)
    want = edgevl.generate(model, PROMPT, video=str(gif), max_new_tokens=12, temperature=0, thinking=False)
    assert want.strip()       # an answer to compare (no thinking: the tiny model's reasoning is all of it)
    return pk, model, str(gif), want


def test_run_and_its_options(setup, capsys):
    pk, model, gif, want = setup
    code, out, _ = cli(capsys, "run", pk, "--prompt", PROMPT, "--video", gif, "--max-new-tokens", 12,
                       "--temperature", 0, "--no-thinking")
    assert code == 0 and out == want + "\n"
    code, out, _ = cli(capsys, "run", pk, "--prompt", PROMPT, "--video", gif, "--max-new-tokens", 12,
                       "--temperature", 0, "--fps", 1, "--max-frames", 2, "--no-thinking")
    other = edgevl.generate(model, PROMPT, video=gif, max_new_tokens=12, temperature=0, thinking=False,
                            video_options={"fps": 1, "max_frames": 2})
    assert code == 0 and out == other + "\n" and other != want
    code, _, err = cli(capsys, "run", pk, "--prompt", PROMPT, "--video", gif, "--max-new-tokens", 2, "-v")
    assert code == 0 and "[video 1: 4 frames sampled (5 fps source), " in err and " temporal patches, " in err
    for args, needle in ((["--video", "missing.mp4"], "video not found"), (["--video", gif, "--fps", "0"], "--fps"),
                         (["--video", gif, "--max-frames", "1"], "--max-frames must be >= 2"),
                         (["--video", gif, "--raw"], "--raw cannot be combined")):
        one_line_error(*cli(capsys, "run", pk, "--prompt", PROMPT, *args)[::2], needle)


def test_models_without_video_say_so(capsys, tmp_path):
    code, _, err = cli(capsys, "run", demo_package(), "--prompt", PROMPT, "--video", str(tmp_path))
    one_line_error(code, err, "takes no video")
    # a text-only Qwen3.5 (a family that takes video) lacks the tower, not the family the video
    from PIL import Image

    ck = make_qwen3_5(tmp_path / "ck", text_only=True)
    pk = edgevl.convert(ck, tmp_path / "pk", dtype="fp32", progress=False)
    code, _, err = cli(capsys, "run", pk, "--prompt", PROMPT, "--video", str(tmp_path))
    one_line_error(code, err, "this model has no vision tower; it takes no video")
    with pytest.raises(EdgevlError, match="this model has no vision tower; it takes no video"):
        edgevl.generate(edgevl.load(pk), PROMPT, video=[Image.new("RGB", (64, 64))] * 2)


def test_chat_video_first_and_by_command(setup):
    pk, model, gif, want = setup
    for kwargs, lines in (({"video": gif}, [PROMPT, "/quit"]), ({}, [f"/video {gif}", PROMPT, "/quit"])):
        said = []
        feed = iter(lines)
        model.reset()
        chat_loop(model, input_fn=lambda _, feed=feed: next(feed), out=_Out(said), max_new_tokens=12, temperature=0,
                  thinking=False, **kwargs)
        text = "".join(said)
        assert "video attached" in text and want in text, text
    said, feed = [], iter(["/video nowhere.gif", "/quit"])
    chat_loop(model, input_fn=lambda _: next(feed), out=_Out(said))
    assert "error: video not found" in "".join(said)


class _Out:
    def __init__(self, said):
        self.said = said

    def write(self, s):
        self.said.append(s)

    def flush(self):
        pass


def test_server_video_url(setup):
    pk, model, gif, want = setup
    srv, _ = make_server(model)
    try:
        port = srv.server_address[1]
        data = base64.b64encode(open(gif, "rb").read()).decode()

        def ask(url):
            return post(port, {"messages": [{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": PROMPT}]}],
                "max_tokens": 12, "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}})

        status, reply, _ = ask(f"data:image/gif;base64,{data}")
        assert status == 200 and reply["choices"][0]["message"]["content"] == want, reply
        for url, needle in (("data:video/mp4;base64,AAAA", "the video"), ("data:video/mp4,abc", "base64"),
                            ("https://example.com/a.mp4", "not fetched"), ("/etc/passwd", "data: URL")):
            status, reply, _ = ask(url)
            assert status in (400, 403) and needle in reply["error"]["message"], reply
            assert "\n" not in reply["error"]["message"]
    finally:
        srv.stop()


def test_batch_video_column(setup, tmp_path, capsys):
    pk, model, gif, want = setup
    table = tmp_path / "jobs.jsonl"
    table.write_text("\n".join(json.dumps(r) for r in (
        {"id": "a", "video": gif}, {"id": "b", "video": "missing.gif"}, {"id": "c"})) + "\n")
    out = tmp_path / "out.jsonl"
    code, _, err = cli(capsys, "batch", pk, "--input", table, "--prompt", PROMPT, "--output", out,
                       "--max-new-tokens", 12, "--temperature", 0, "--threads", 1, "--quiet", "--no-thinking")
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["a"]["answer"] == want and rows["a"]["video"] == gif and rows["a"]["error"] is None
    assert "video not found" in rows["b"]["error"] and "no image or video" in rows["c"]["error"]
    # how every row's clip is sampled, as in run
    fewer = tmp_path / "fewer.jsonl"
    code, _, err = cli(capsys, "batch", pk, "--input", table, "--prompt", PROMPT, "--output", fewer,
                       "--max-new-tokens", 12, "--temperature", 0, "--threads", 1, "--quiet", "--no-thinking",
                       "--fps", 1, "--max-frames", 2)
    other = edgevl.generate(model, PROMPT, video=gif, max_new_tokens=12, temperature=0, thinking=False,
                            video_options={"fps": 1, "max_frames": 2})
    got = {r["id"]: r for r in map(json.loads, fewer.read_text().splitlines())}["a"]
    assert got["answer"] == other != want and got["tokens_in"] < rows["a"]["tokens_in"], got
    # the demo model takes no video: refused before any row, not each video row failing
    none = tmp_path / "none.jsonl"
    one_line_error(*cli(capsys, "batch", "--input", table, "--prompt", PROMPT, "--output", none,
                        "--quiet")[::2], "takes no video")
    assert not none.exists()


def test_api_refusals(setup):
    pk, model, gif, _ = setup
    with pytest.raises(EdgevlError, match="1 video parts but 0 videos"):
        edgevl.generate(model, [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "hi"}]}])
    with pytest.raises(EdgevlError, match="either inside the messages or with video="):
        edgevl.generate(model, [{"role": "user", "content": [{"type": "video", "video": gif}]}], video=gif)
    with pytest.raises(EdgevlError, match="need the chat template"):
        edgevl.generate(model, PROMPT, video=gif, raw=True)


def test_a_list_of_picture_paths_is_one_clip(setup, tmp_path):
    """`video=[f0.png, f1.png, ...]` is the frames of one clip, as `{"frames": [...]}` is (as clips,
    each would be a one-frame video, which is refused)."""
    pk, model, gif, _ = setup
    from PIL import Image

    frames = []
    with Image.open(gif) as im:
        for k in range(im.n_frames):
            im.seek(k)
            frames.append(tmp_path / f"f{k}.png")
            im.convert("RGB").save(frames[-1])
    kw = dict(max_new_tokens=6, temperature=0, thinking=False)
    want = edgevl.generate(model, PROMPT, video={"frames": [str(f) for f in frames]}, **kw)
    assert edgevl.generate(model, PROMPT, video=[str(f) for f in frames], **kw) == want


def test_a_prompt_with_videos_that_just_fits_is_taken(setup, monkeypatch):
    """The early check counted each video's start and end tokens twice (its own groups replace
    the template's): a prompt two tokens per video short of the context was refused, and the
    server's 400 said it had the whole context's tokens."""
    from edgevl.generate import prepare

    pk, model, gif, _ = setup
    for n in (1, 2):
        monkeypatch.undo()
        msgs = [{"role": "user", "content": [*[{"type": "video", "video": gif}] * n, {"type": "text", "text": PROMPT}]}]
        real = len(prepare(model, msgs, thinking=False).input_ids)
        # the context just fits the prompt and one answer token, in the API and the server
        monkeypatch.setattr(model, "max_context", real + 1)
        assert edgevl.generate(model, msgs, max_new_tokens=1, thinking=False) is not None
        srv, _ = make_server(model, max_queue=2)
        try:
            url = "data:image/gif;base64," + base64.b64encode(open(gif, "rb").read()).decode()
            code, body, _ = post(srv.server_address[1], {"messages": [{"role": "user", "content": [
                *[{"type": "video_url", "video_url": {"url": url}}] * n, {"type": "text", "text": PROMPT}]}],
                "max_tokens": 1, "chat_template_kwargs": {"enable_thinking": False}})
        finally:
            srv.stop()
        assert code == 200 and body["usage"]["prompt_tokens"] == real, body
        monkeypatch.setattr(model, "max_context", real)      # and one token less is refused
        with pytest.raises(EdgevlError, match="maximum context length"):
            edgevl.generate(model, msgs, max_new_tokens=1, thinking=False)
