"""Video prompts on Qwen3.5 and Qwen3.5-MoE packages vs transformers (fp32 greedy, random tiny
checkpoints): the model class fed the same ``pixel_values_videos``/``video_grid_thw`` and input_ids
in the model authors' format (per temporal patch ``<T seconds>`` and its own vision start/pad/end
group, built here with transformers' own timestamp rule), clips of 4, 7 and 30 frames at odd
sizes and frame rates that do not divide the sampling rate, a video with an image, and a second
chat turn about the same video that prefills only the new message."""

import numpy as np
import pytest
import torch
from PIL import Image

import edgevl
from edgevl.errors import EdgevlError
from edgevl.generate import prepare
from edgevl.processing import video as vid
from edgevl.verification.families.qwen3_5_moe import VERIFY as MOE
from support.common import first_diff, smooth_image
from support.qwen import hf_greedy, hf_processor, load_hf, make_qwen3_5

N_NEW = 24


def clip_frames(n, w, h, seed):
    """n frames of a smooth picture drifting sideways (neighbouring frames alike, as in a video)."""
    base = smooth_image(w + 4 * n, h, seed)
    return [base.crop((4 * i, 0, 4 * i + w, h)) for i in range(n)]


def write_gif(path, frames, fps):
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=int(round(1000 / fps)), loop=0)
    return str(path)


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    root = tmp_path_factory.mktemp("video")
    ck = make_qwen3_5(root / "dense", seed=61)
    moe = MOE.make_tiny(root / "moe", list(MOE.tiny_variants)[0], seed=62)
    out = {"dense": (ck, edgevl.convert(ck, root / "dense-fp32", dtype="fp32", progress=False)),
           "moe": (moe, edgevl.convert(moe, root / "moe-fp32", dtype="fp32", progress=False))}
    clips = {"4f-37x61-3fps": write_gif(root / "a.gif", clip_frames(4, 37, 61, 1), 3),
             "7f-90x50-7fps": write_gif(root / "b.gif", clip_frames(7, 90, 50, 2), 7),
             "30f-71x45-12.5fps": write_gif(root / "c.gif", clip_frames(30, 71, 45, 3), 12.5)}
    return out, clips


_loaded = {}


def _load(packages, name):
    if name not in _loaded:
        from transformers import Qwen3_5MoeForConditionalGeneration

        ck, pk = packages[0][name]
        ref = (load_hf(ck) if name == "dense"
               else Qwen3_5MoeForConditionalGeneration.from_pretrained(ck, dtype=torch.float32).eval())
        _loaded[name] = (edgevl.load(pk), ref, hf_processor(ck))
    return _loaded[name]


def reference_inputs(model, proc, messages, images, videos, **template_kwargs):
    """input_ids and tensors for transformers: the chat template's text with each video's
    ``<|vision_start|><|video_pad|><|vision_end|>`` replaced as the authors' processor does
    (timestamps from transformers' ``_calculate_timestamps``), the images through transformers'
    image processor, the videos' pixels from edgevl's video processor (its own rules are
    compared with transformers' in test_video_processor.py)."""
    cfg = model.vision.video_cfg
    text = proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)
    pv, grids = [], []
    for v in videos:
        s = vid.load_video(v, cfg)
        stamps = proc._calculate_timestamps(list(s.indices), s.source_fps, cfg.temporal_patch_size)
        t, h, w = s.grid_thw
        n = h * w // cfg.merge_size ** 2
        groups = "".join(f"<{x:.1f} seconds><|vision_start|>" + "<|video_pad|>" * n + "<|vision_end|>"
                         for x in stamps)
        text = text.replace("<|vision_start|><|video_pad|><|vision_end|>", "\0", 1).replace("\0", groups)
        pv += [vid.patch_rows(np.stack(s.frames[k:k + 2]), cfg) for k in range(0, len(s.frames), 2)]
        grids.append([t, h, w])
    # its checks count pads (in the text, and in the ids), which are expanded here: a token and an
    # id that never occur turn them off
    saved = proc.video_token, proc.video_token_id
    proc.video_token, proc.video_token_id = "<|no video token here|>", -1
    try:
        enc = proc(text=[text], images=images or None, return_tensors="pt")
    finally:
        proc.video_token, proc.video_token_id = saved
    ids = enc["input_ids"]
    enc["pixel_values_videos"] = torch.from_numpy(np.concatenate(pv))
    enc["video_grid_thw"] = torch.tensor(grids)
    cfgm = model.config
    enc["mm_token_type_ids"] = ((ids == cfgm["image_token_id"]).int() + 2 * (ids == cfgm["video_token_id"]).int())
    return ids[0].tolist(), enc


def _video_ids_equal(model, proc, msgs, images, videos):
    ids, enc = reference_inputs(model, proc, msgs, images, videos)
    prep = prepare(model, [{**m, "content": [
        dict(p, image=images[0]) if p.get("type") == "image" else dict(p, video=videos[0]) if p.get("type") == "video"
        else p for p in m["content"]]} for m in msgs])
    assert prep.input_ids == ids
    return ids, enc, prep


@pytest.mark.parametrize("clip", ["4f-37x61-3fps", "7f-90x50-7fps", "30f-71x45-12.5fps"])
@pytest.mark.parametrize("name", ["dense", "moe"])
def test_video_greedy_token_exact(packages, name, clip):
    model, ref, proc = _load(packages, name)
    path = packages[1][clip]
    msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
    ids, enc, prep = _video_ids_equal(model, proc, msgs, [], [path])
    assert "seconds>" in model.tokenizer.decode(ids, skip_special_tokens=False)
    ours = list(model.generate_tokens(prep.input_ids, N_NEW, image=prep.encoded, ignore_eos=True, reuse_cache=False))
    theirs = hf_greedy(ref, enc, N_NEW)
    assert ours == theirs, f"first differing token at {first_diff(ours, theirs)}"


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_video_and_image_in_one_prompt(packages, name):
    model, ref, proc = _load(packages, name)
    img = smooth_image(83, 47, 9)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "then"}, {"type": "video"},
                                         {"type": "text", "text": "Same place?"}]}]
    ids, enc, prep = _video_ids_equal(model, proc, msgs, [img], [packages[1]["7f-90x50-7fps"]])
    ours = list(model.generate_tokens(prep.input_ids, N_NEW, image=prep.encoded, ignore_eos=True, reuse_cache=False))
    theirs = hf_greedy(ref, enc, N_NEW)
    assert ours == theirs, f"first differing token at {first_diff(ours, theirs)}"


def test_second_turn_about_the_video_prefills_only_the_new_message(packages):
    model, ref, proc = _load(packages, "dense")
    _, pk = packages[0]["dense"]
    path = packages[1]["30f-71x45-12.5fps"]
    model.reset()
    turn1 = [{"role": "user", "content": [{"type": "video", "video": path}, {"type": "text", "text": "What moves?"}]}]
    done = edgevl.complete(model, turn1, max_new_tokens=10, temperature=0,
                           chat_template_kwargs={"enable_thinking": False})
    turn2 = turn1 + [{"role": "assistant", "content": done.text}, {"role": "user", "content": "And then?"}]
    plain = [{**m, "content": [{"type": "video"} if p.get("type") == "video" else p for p in m["content"]]}
             if isinstance(m["content"], list) else m for m in turn2]
    kw = {"chat_template_kwargs": {"enable_thinking": False}}
    prep = prepare(model, turn2, **kw)
    text = proc.apply_chat_template(plain, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert text.count("<|video_pad|>") == 1
    second = list(model.generate_tokens(prep.input_ids, N_NEW, image=prep.encoded, ignore_eos=True))
    ids1 = prepare(model, turn1, **kw).input_ids
    common = next(i for i, (a, b) in enumerate(zip(ids1, prep.input_ids)) if a != b)
    assert common > sum(1 for t in ids1 if t == model.video_token_id)     # the video lies in the shared part
    assert model.last_prefill_tokens <= len(prep.input_ids) - common + 8  # only turn 2's text is computed
    fresh = list(edgevl.load(pk).generate_tokens(prep.input_ids, N_NEW, image=prep.encoded, ignore_eos=True))
    assert second == fresh, f"first differing token at {first_diff(second, fresh)}"
    ids, enc = reference_inputs(model, proc, plain, [], [path], enable_thinking=False)
    assert ids == prep.input_ids
    assert fresh == hf_greedy(ref, enc, N_NEW)


def test_video_api_forms_give_the_same_rows(packages, tmp_path):
    """A GIF, a folder of its frames and a list of its frames with their fps are one clip."""
    model = _load(packages, "dense")[0]
    with Image.open(packages[1]["7f-90x50-7fps"]) as gif:     # its frames as the GIF palette left them
        frames = []
        for i in range(gif.n_frames):
            gif.seek(i)
            frames.append(gif.convert("RGB"))
    folder = tmp_path / "frames"
    folder.mkdir()
    for i, f in enumerate(frames):
        f.save(folder / f"frame_{i + 1}.png")
    a, ia = model.encode_video(packages[1]["7f-90x50-7fps"])
    b, ib = model.encode_video({"path": str(folder), "fps": 7})
    c, ic = model.encode_video({"frames": frames, "fps": 7})
    d, _ = model.encode_video({"frames": [np.asarray(f) for f in frames], "fps": 7})
    assert ia["frame_indices"] == ib["frame_indices"] == ic["frame_indices"] == [0, 2, 4, 6]
    assert ib["timestamps"] == ic["timestamps"] == pytest.approx([1 / 7, 5 / 7])
    assert ia["timestamps"] == pytest.approx([0.14, 0.7])      # GIF frame times are whole 10 ms: 140 ms
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)
    np.testing.assert_array_equal(a, d)
    # options: a lower sampling rate keeps the minimum of 4 frames, max_frames cuts below it
    _, few = model.encode_video(packages[1]["30f-71x45-12.5fps"], max_frames=2)
    assert few["frame_indices"] == [0, 29] and few["grid_thw"][0] == 1
    _, slow = model.encode_video(packages[1]["30f-71x45-12.5fps"], fps=0.5)
    assert len(slow["frame_indices"]) == 4
    _, small = model.encode_video(packages[1]["30f-71x45-12.5fps"], max_pixels=4 * 32 * 32)
    assert small["resized_size"] == (32, 32)


def test_pyav_clip_matches_its_frames(packages, tmp_path):
    """An MP4 written with PyAV (lossless settings aside, its decoded frames are what the model
    sees): rows equal those of its own decoded frames given as a list at the clip's fps."""
    av = pytest.importorskip("av", reason="PyAV is the optional video extra; the test extra installs it")
    model = _load(packages, "dense")[0]
    path = tmp_path / "clip.mp4"
    frames = clip_frames(20, 96, 64, 4)
    with av.open(str(path), "w") as c:
        s = c.add_stream("mpeg4", rate=10)
        s.width, s.height, s.pix_fmt = 96, 64, "yuv420p"
        for f in frames:
            for pkt in s.encode(av.VideoFrame.from_image(f)):
                c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)
    with av.open(str(path)) as c:
        decoded = [f.to_image() for f in c.decode(video=0)]
    assert len(decoded) == 20
    a, ia = model.encode_video(str(path))
    b, ib = model.encode_video({"frames": decoded, "fps": 10})
    assert ia["frame_indices"] == ib["frame_indices"] and ia["source_fps"] == 10
    np.testing.assert_array_equal(a, b)


def test_folder_frames_in_numeric_order(tmp_path):
    for i in range(12):
        Image.new("RGB", (8, 8), (i, 0, 0)).save(tmp_path / f"f{i + 1}.png")
    clip = vid.open_clip(str(tmp_path))
    assert [im.getpixel((0, 0))[0] for _, im in clip.read(range(12))] == list(range(12))
    # hidden files are no frames (a viewer's thumbnail was frame 0; a macOS "._" fork failed the clip)
    Image.new("RGB", (8, 8), (0, 255, 0)).save(tmp_path / ".thumb.png")
    (tmp_path / "._f1.png").write_bytes(b"\0\5\26\7 resource fork")
    clip = vid.open_clip(str(tmp_path))
    assert clip.total == 12 and [im.getpixel((0, 0))[0] for _, im in clip.read(range(12))] == list(range(12))
    (tmp_path / "only-hidden").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "only-hidden" / ".a.png")
    with pytest.raises(EdgevlError, match="holds no frame images .* named with a leading dot, are skipped"):
        vid.open_clip(str(tmp_path / "only-hidden"))
