"""edgevl's video processor against transformers' ``Qwen3VLVideoProcessor`` rules, called
directly: its frame sampling, its (frames, height, width) ``smart_resize`` (with and without the
per-frame cap), its ``patchify`` layout, and the authors' timestamp rule. transformers' class
needs torchvision to decode and resize, which cannot be installed beside this CPU build of torch.
Its resize is torchvision's antialiased bicubic on the uint8 frame, which on CPU is torch's
``interpolate(..., mode="bicubic", antialias=True)`` on the uint8 tensor: sampled frames are
compared with that call pixel for pixel. Decoding is not compared here."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize
from transformers.video_utils import VideoMetadata

from edgevl.errors import EdgevlError
from edgevl.processing import video as vid

CFG = vid.VideoConfig()


def hf_indices(total, src_fps, fps=None, max_frames=768):
    me = SimpleNamespace(fps=2, min_frames=4, max_frames=max_frames)
    meta = VideoMetadata(total_num_frames=total, fps=src_fps)
    return Qwen3VLVideoProcessor.sample_frames(me, meta, fps=fps).tolist()


@pytest.mark.parametrize("total,src_fps,fps,max_frames", [
    (4, 3, None, 768), (7, 7, None, 768), (30, 12.5, None, 768), (3, 30, None, 768), (1800, 29.97, None, 768),
    (100, 24, 0.5, 768), (100, 24, 5, 768), (20000, 25, None, 768), (20000, 25, None, 64), (9, None, None, 768),
    (61, 23.976, 1, 768), (2, 1, None, 768)])
def test_frame_sampling(total, src_fps, fps, max_frames):
    cfg = vid.VideoConfig(max_frames=max_frames)
    ours = vid.sample_indices(total, src_fps, cfg, fps).tolist()
    assert ours == hf_indices(total, src_fps, fps, max_frames)


@pytest.mark.parametrize("cap", [False, True])
def test_resize_rule(cap):
    rng = np.random.default_rng(0)
    cfg = vid.VideoConfig(cap_pixels_per_frame=cap, min_pixels=4096, max_pixels=25165824)
    for _ in range(300):
        n = int(rng.integers(2, 400))
        h, w = int(rng.integers(20, 2200)), int(rng.integers(20, 2200))
        max_px = cfg.max_pixels
        if cap:   # transformers' resize applies the cap before its smart_resize
            per = max(min(cfg.max_video_tokens * 32 * 32, max_px // n), int(cfg.min_pixels * 1.05))
            max_px = per * n
        want = smart_resize(n, h, w, 2, 32, cfg.min_pixels, max_px)
        assert vid.video_smart_resize(n, h, w, cfg) == want, (n, h, w)


def test_timestamps():
    for indices, fps in (([0, 2, 4, 6], 7.0), ([0, 10, 20], 12.5), (list(range(0, 1800, 15)), 29.97), ([0, 1], 2)):
        want = Qwen3VLProcessor._calculate_timestamps(None, list(indices), fps, 2)
        assert vid.timestamps(indices, fps, 2) == want


@pytest.mark.parametrize("src,min_pixels,max_pixels,want", [
    ((61, 37), 4096, 4096, (32, 32)),          # both sides down
    ((90, 50), 4096, 25165824, (96, 64)),      # both up
    ((47, 83), 1024, 65536, (32, 96)),         # height down, width up
    ((130, 300), 1024, 8192, (32, 64)),        # down by 4 and 4.7
])
def test_frames_are_resized_as_torchvision_does(src, min_pixels, max_pixels, want):
    """Each sampled frame is what torchvision's uint8 bicubic resize gives: torch's interpolate
    on the uint8 tensor, pixel for pixel."""
    h, w = src
    rng = np.random.default_rng(h * w)
    frames = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in range(4)]
    s = vid.load_video({"frames": frames, "fps": 2}, vid.VideoConfig(min_pixels=min_pixels, max_pixels=max_pixels))
    th, tw = s.resized_size
    assert (th, tw) == want
    for i, frame in zip(s.indices, s.frames):
        t = torch.from_numpy(frames[i]).permute(2, 0, 1)[None].contiguous()
        ref = torch.nn.functional.interpolate(t, size=(th, tw), mode="bicubic", antialias=True, align_corners=False)
        np.testing.assert_array_equal(frame, ref[0].permute(1, 2, 0).numpy())


@pytest.mark.parametrize("mean,std", [([0.5] * 3, [0.5] * 3),
                                       ([0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711])])
def test_patch_layout_and_values(mean, std):
    """Rows equal transformers' video path bit for bit: its fused rescale+normalize (mean and std
    scaled by 1 / rescale_factor in float32, then (x - mean) / std on the uint8 frames as float32),
    then its ``patchify``."""
    rng = np.random.default_rng(1)
    frames = rng.integers(0, 256, (2, 64, 96, 3), dtype=np.uint8)
    ours = vid.patch_rows(frames, vid.VideoConfig(image_mean=mean, image_std=std))
    x = torch.from_numpy(frames).permute(0, 3, 1, 2).to(torch.float32)
    m, s = torch.tensor(mean) * (1.0 / (1 / 255)), torch.tensor(std) * (1.0 / (1 / 255))
    x = x.sub_(m[:, None, None]).div_(s[:, None, None])
    theirs, t, h, w = Qwen3VLVideoProcessor.patchify(None, x[None], 16, 2, 2)
    assert (t, h, w) == (1, 4, 6)
    np.testing.assert_array_equal(ours, theirs[0].numpy())


def test_config_files(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text('{"image_mean": [0.1, 0.2, 0.3], "size": {"longest_edge": 9}}')
    c = vid.VideoConfig.from_folder(tmp_path)
    assert c.image_mean == [0.1, 0.2, 0.3] and c.max_pixels == CFG.max_pixels   # an image budget is per image
    (tmp_path / "video_preprocessor_config.json").write_text(
        '{"fps": 1, "max_frames": 64, "size": {"shortest_edge": 1024, "longest_edge": 65536}}')
    c = vid.VideoConfig.from_folder(tmp_path)
    assert (c.fps, c.max_frames, c.min_pixels, c.max_pixels, c.image_mean) == (1, 64, 1024, 65536, [0.5] * 3)
    (tmp_path / "video_preprocessor_config.json").write_text('{"fps": 0}')
    with pytest.raises(EdgevlError, match="fix video_preprocessor_config.json"):
        vid.VideoConfig.from_folder(tmp_path)
    (tmp_path / "video_preprocessor_config.json").write_text('{"fps": ')
    with pytest.raises(EdgevlError, match="is not valid JSON"):
        vid.VideoConfig.from_folder(tmp_path)


def test_only_sampled_frames_are_read_and_kept(tmp_path, monkeypatch):
    """A long clip: the reader is asked for the sampled frames only, and only they are kept."""
    asked = []
    clip = vid.Clip(9000, 30.0, 320, 180, lambda idx: ((asked.append(i), (i, Image.new("RGB", (320, 180))))[1]
                                                         for i in idx))
    monkeypatch.setattr(vid, "open_clip", lambda v: clip)
    s = vid.load_video("x", vid.VideoConfig(max_pixels=600 * 32 * 32))
    assert len(asked) == len(s.frames) == 600 and s.indices == asked          # 300 s at 2 fps
    assert s.frames[0].shape == (*s.resized_size, 3) and s.resized_size[0] * s.resized_size[1] <= 32 * 32


@pytest.mark.parametrize("make,msg", [
    (lambda p: p / "missing.mp4", "video not found"),
    (lambda p: (p / "empty").mkdir() or p / "empty", "holds no frame images"),
    (lambda p: (Image.new("RGB", (40, 40)).save(p / "one.png"), p / "one.png")[1], "needs at least 2"),
    (lambda p: ((p / "junk.gif").write_bytes(b"GIF89a" + bytes(50)), p / "junk.gif")[1], "cannot be read|needs PyAV"),
    (lambda p: ((p / "t.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(40)), p / "t.mp4")[1],
     "cannot be read as a video|needs PyAV"),
])
def test_bad_clips_are_one_line_errors(tmp_path, make, msg):
    with pytest.raises(EdgevlError, match=msg) as e:
        vid.load_video(str(make(tmp_path)), CFG)
    assert "\n" not in str(e.value)


def test_bad_options_and_frames():
    frames = [Image.new("RGB", (64, 64))] * 4
    with pytest.raises(EdgevlError, match="fps must be a positive number"):
        vid.load_video({"frames": frames, "fps": -1}, CFG)
    with pytest.raises(EdgevlError, match="max_frames must be at least 2"):
        vid.load_video({"frames": frames}, CFG, max_frames=1)
    with pytest.raises(EdgevlError, match="frames differ in size"):
        vid.load_video({"frames": frames[:2] + [Image.new("RGB", (32, 64))] * 2}, CFG)
    with pytest.raises(EdgevlError, match=r"uint8 \[height, width, 3\]"):
        vid.load_video({"frames": [np.zeros((4, 4), np.float32)] * 4}, CFG)
    with pytest.raises(EdgevlError, match="lasts over"):
        vid.load_video({"frames": frames * 10, "fps": 0.001}, CFG)
    with pytest.raises(EdgevlError, match=r"the video is 2100x8: its aspect ratio exceeds"):  # its own size
        vid.load_video({"frames": [Image.new("RGB", (2100, 8))] * 2}, CFG)


@pytest.mark.parametrize("codec,ext", [("mpeg4", "mp4"), ("libvpx-vp9", "webm")])
def test_pyav_clips_and_truncated_files(tmp_path, codec, ext):
    av = pytest.importorskip("av", reason="PyAV is the optional video extra; the test extra installs it")
    path = tmp_path / f"clip.{ext}"
    with av.open(str(path), "w") as c:
        s = c.add_stream(codec, rate=10)
        s.width, s.height, s.pix_fmt = 96, 64, "yuv420p"
        for i in range(40):
            for pkt in s.encode(av.VideoFrame.from_ndarray(np.full((64, 96, 3), 6 * i, np.uint8), format="rgb24")):
                c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)
    clip = vid.open_clip(str(path))
    assert (clip.total, clip.fps, clip.width, clip.height) == (40, 10.0, 96, 64)
    s = vid.load_video(str(path), CFG)
    assert s.indices == hf_indices(40, 10.0) and len(s.frames) == 8
    # each kept frame is the one at its index (flat greys 6 * index, 30 levels apart at this sampling)
    means = [float(f.mean()) for f in s.frames]
    assert all(abs(m - 6 * i) <= 12 for m, i in zip(means, s.indices)), (means, s.indices)
    cut = tmp_path / f"cut.{ext}"
    cut.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    with pytest.raises(EdgevlError, match="truncated|cannot be read as a video") as e:
        vid.load_video(str(cut), CFG)
    assert "\n" not in str(e.value)
