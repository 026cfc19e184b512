"""Video input for the Qwen3-VL vision tower (Qwen3.5, Qwen3.5-MoE, the Youtu MoE) in numpy + Pillow.

Follows transformers' ``Qwen3VLVideoProcessor`` and the model authors' prompt format
(docs/video.md):

1. the clip's frame count and frame rate are read first; ``fps`` frames per second are sampled
   (at least ``min_frames``, at most ``max_frames`` and the clip's own count) at
   ``linspace(0, total - 1, n).round()``;
2. one size for all frames: ``smart_resize`` over (frames, height, width), the pixel budget
   (``size.longest_edge``) shared by the sampled frames;
3. frames are decoded one at a time and only the sampled ones are kept, already resized (8-bit
   RGB, Pillow BICUBIC), so a long clip never sits in memory; an odd count repeats the last frame;
4. two consecutive frames make one temporal patch; the prompt gets, per temporal patch,
   ``<{t:.1f} seconds>`` (the mean time of its first and last frame) and its own
   ``<|vision_start|><|video_pad|>... <|vision_end|>`` group.

Decoding: animated GIF/WebP/PNG and folders of frames with Pillow; every other container (MP4,
WebM, MOV, MKV ...) with PyAV (``pip install 'edgevl[video]'``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from ..errors import EdgevlError
from .image import load_image
from .qwen_vl import read_fields

FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
UNKNOWN_FPS = 24.0            # transformers' assumption for a clip without a frame rate
MAX_DURATION_S = 4 * 3600     # longer clips are refused before decoding
MAX_FRAME_PIXELS = 8192 * 8192
MAX_ASPECT = 200


@dataclass
class VideoConfig:
    """``video_preprocessor_config.json`` (or ``preprocessor_config.json``) over the class defaults
    of transformers' ``Qwen3VLVideoProcessor``."""
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 128 * 32 * 32           # size.shortest_edge: over all sampled frames
    max_pixels: int = 32 * 32 * 768           # size.longest_edge: over all sampled frames
    image_mean: list = field(default_factory=lambda: [0.5, 0.5, 0.5])
    image_std: list = field(default_factory=lambda: [0.5, 0.5, 0.5])
    rescale_factor: float = 1 / 255
    resample: int = Image.BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768

    @classmethod
    def from_dict(cls, d: dict) -> VideoConfig:
        c = read_fields(cls(), d, ("patch_size", "temporal_patch_size", "merge_size", "rescale_factor", "resample",
                                   "do_resize", "do_rescale", "do_normalize", "fps", "min_frames", "max_frames",
                                   "cap_pixels_per_frame", "max_video_tokens"), typed=True)
        if c.min_pixels > c.max_pixels or c.min_frames < 1 or c.max_frames < c.min_frames or not c.fps > 0:
            raise EdgevlError("the video processor config has inconsistent sizes or frame counts (min above max, "
                              "or fps not positive); fix video_preprocessor_config.json")
        return c

    @classmethod
    def from_folder(cls, folder) -> VideoConfig:
        """The checkpoint's video processor settings: ``video_preprocessor_config.json``, else
        ``preprocessor_config.json`` (as transformers falls back), else the defaults."""
        for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
            p = Path(folder) / name
            if p.is_file():
                try:
                    d = json.loads(p.read_text())
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise EdgevlError(f"{p} is not valid JSON ({e}); fix or re-download it") from None
                if not isinstance(d, dict):
                    raise EdgevlError(f"{p} must hold a JSON object; fix or re-download it")
                if name == "preprocessor_config.json":   # an image processor's pixel budget is per image
                    d = {k: v for k, v in d.items() if k not in ("size", "min_pixels", "max_pixels")}
                try:
                    return cls.from_dict(d)
                except (TypeError, ValueError) as e:
                    raise EdgevlError(f"{p} holds a value of the wrong type ({e}); fix or re-download it") from None
        return cls()

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def sample_indices(total: int, source_fps: float | None, cfg: VideoConfig, fps: float | None = None,
                   max_frames: int | None = None) -> np.ndarray:
    """The source frame indices kept: ``fps`` per second of the clip (the processor's rule)."""
    fps = cfg.fps if fps is None else fps
    top = cfg.max_frames if max_frames is None else max_frames
    n = int(total / (source_fps or UNKNOWN_FPS) * fps)
    n = min(max(n, cfg.min_frames), top, total)
    return np.linspace(0, total - 1, n).round().astype(int)


def video_smart_resize(frames: int, height: int, width: int, cfg: VideoConfig,
                       max_pixels: int | None = None) -> tuple[int, int]:
    """One (height, width) for every frame: sides to multiples of patch x merge, the pixel count
    of all ``frames`` within [min_pixels, max_pixels] (transformers' video ``smart_resize``)."""
    tf, factor = cfg.temporal_patch_size, cfg.factor
    min_px = cfg.min_pixels
    max_px = cfg.max_pixels if max_pixels is None else max_pixels
    if cfg.cap_pixels_per_frame:
        per_frame = max(min(cfg.max_video_tokens * factor * factor, max_px // frames), int(min_px * 1.05))
        max_px = per_frame * frames
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise EdgevlError(f"the video is {width}x{height}: its aspect ratio exceeds {MAX_ASPECT}:1; crop it first")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(frames / tf) * tf
    if t_bar * h_bar * w_bar > max_px:
        beta = math.sqrt(frames * height * width / max_px)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_px:
        beta = math.sqrt(min_px / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def timestamps(indices, source_fps: float | None, group: int) -> list[float]:
    """Seconds of each temporal patch: the mean of its first and last frame's time (the last
    frame repeated to fill the final patch), as the model authors' processor writes them."""
    idx = [int(i) for i in indices]
    idx += [idx[-1]] * (-len(idx) % group)
    t = [i / (source_fps or UNKNOWN_FPS) for i in idx]
    return [(t[i] + t[i + group - 1]) / 2 for i in range(0, len(t), group)]


def patch_rows(frames: np.ndarray, cfg: VideoConfig) -> np.ndarray:
    """One temporal patch: uint8 frames [T, H, W, 3] -> rows [gh*gw, C*T*p*p] (float32) in merge-
    block order, each row (C, T, p, p) as the processor's ``patchify`` lays it out."""
    t, h, w, c = frames.shape
    p, m = cfg.patch_size, cfg.merge_size
    x = frames.transpose(0, 3, 1, 2)                          # (T, C, H, W)
    x = (x.astype(np.float64) * cfg.rescale_factor).astype(np.float32) if cfg.do_rescale else x.astype(np.float32)
    if cfg.do_normalize:
        x = (x - np.asarray(cfg.image_mean, np.float32)[:, None, None]) / np.asarray(cfg.image_std,
                                                                                  np.float32)[:, None, None]
    gh, gw = h // p, w // p
    x = x.reshape(t, c, gh // m, m, p, gw // m, m, p).transpose(2, 5, 3, 6, 1, 0, 4, 7)
    return np.ascontiguousarray(x, np.float32).reshape(gh * gw, c * t * p * p)


# ---------------------------------------------------------------------------------------------
# sources: what a clip is and how its frames are read


@dataclass
class Clip:
    """A clip's frame count, frame rate (None: unknown), size and a reader of chosen frames."""
    total: int
    fps: float | None
    width: int
    height: int
    read: object          # (sorted indices) -> iterator of (index, PIL RGB image)
    name: str = "the video"


def _frames_clip(frames: list, fps: float | None, name: str) -> Clip:
    if not frames:
        raise EdgevlError(f"{name} has no frames; give at least {2} images")
    first = _frame(frames[0])

    def read(indices):
        for i in indices:
            yield i, first if i == 0 else _frame(frames[i])

    return Clip(len(frames), fps, first.width, first.height, read, name)


def _frame(x) -> Image.Image:
    if isinstance(x, np.ndarray):
        if x.dtype != np.uint8 or x.ndim != 3 or x.shape[2] != 3:
            raise EdgevlError(f"a frame given as an array must be uint8 [height, width, 3], got {x.dtype} "
                              f"{list(x.shape)}")
        return Image.fromarray(x)
    return load_image(x)


def _folder_clip(folder: Path, fps: float | None) -> Clip:
    files = sorted((p for p in folder.iterdir() if p.suffix.lower() in FRAME_SUFFIXES),
                   key=lambda p: [int(s) if s.isdigit() else s for s in _digit_runs(p.name)])
    if not files:
        raise EdgevlError(f"{folder} holds no frame images ({', '.join(FRAME_SUFFIXES)}); give a folder of frames "
                          "or a video file")
    return _frames_clip([str(p) for p in files], fps, str(folder))


def _digit_runs(s: str) -> list[str]:
    import re

    return re.findall(r"\d+|\D+", s)


def _pillow_clip(path: Path, fps: float | None) -> Clip | None:
    """An animated GIF/WebP/PNG through Pillow (None: Pillow cannot read the file)."""
    try:
        im = Image.open(path)
    except (UnidentifiedImageError, OSError):
        return None
    n = int(getattr(im, "n_frames", 1))
    if fps is None:
        durations = []
        for i in range(min(n, 64)):     # the mean frame time of the first frames
            im.seek(i)
            durations.append(im.info.get("duration") or 0)
        im.seek(0)
        mean = sum(durations) / len(durations) if durations else 0
        fps = 1000.0 / mean if mean > 0 else None
    width, height = im.size
    im.close()

    def read(indices):
        with Image.open(path) as src:
            for i in indices:
                try:
                    src.seek(i)
                    frame = src.convert("RGB")
                except (OSError, EOFError, ValueError) as e:
                    raise EdgevlError(f"{path}: frame {i + 1} cannot be decoded ({e}); the file is damaged or "
                                      "truncated") from None
                yield i, frame

    return Clip(n, fps, width, height, read, str(path))


def _pyav_clip(path: Path, fps: float | None) -> Clip:
    try:
        import av
    except ImportError:
        raise EdgevlError(f"reading {path.suffix or 'this'} video files needs PyAV: pip install 'edgevl[video]' "
                          "(or give an animated GIF/WebP or a folder of frames)") from None
    try:
        with av.open(str(path)) as c:
            if not c.streams.video:
                raise EdgevlError(f"{path} has no video stream")
            s = c.streams.video[0]
            rate = s.average_rate or s.guessed_rate
            src_fps = float(rate) if rate else None
            total = int(s.frames or 0)
            width, height = s.codec_context.width, s.codec_context.height
            if total <= 0:      # containers without a frame count (WebM, some MKV): count packets
                total = sum(1 for pkt in c.demux(s) if pkt.size)
                announced = c.duration / 1e6 * src_fps if c.duration and src_fps else None
                if announced and total < 0.9 * announced - 2:
                    raise EdgevlError(f"{path} holds {total} frames but its header announces {announced:.0f}; "
                                      "the file is truncated")
    except EdgevlError:
        raise
    except (av.error.FFmpegError, OSError, ValueError) as e:
        raise EdgevlError(f"{path} cannot be read as a video ({' '.join(str(e).split())[:120]}); check the "
                          "file") from None

    def read(indices):
        want = iter(indices)
        nxt = next(want, None)
        try:
            with av.open(str(path)) as c:
                for i, frame in enumerate(c.decode(video=0)):
                    if nxt is None:
                        return
                    if i == nxt:
                        img = frame.to_image()
                        while nxt == i:   # a short clip may repeat an index
                            yield i, img
                            nxt = next(want, None)
        except (av.error.FFmpegError, OSError, ValueError) as e:
            raise EdgevlError(f"{path}: decoding failed ({' '.join(str(e).split())[:120]}); the file is damaged "
                              "or its codec is not supported") from None
        if nxt is not None:
            raise EdgevlError(f"{path} ended before frame {nxt + 1} of the {total} its header announces; the file "
                              "is truncated")

    return Clip(total, fps if fps is not None else src_fps, width, height, read, str(path))


def open_clip(video) -> Clip:
    """A path (video file, animated image, folder of frames), a list of frames (paths / PIL /
    arrays), or ``{"frames": [...] or "path": ..., "fps": source frame rate}``."""
    fps = None
    if isinstance(video, dict):
        fps = video.get("fps")
        if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0):
            raise EdgevlError(f"a video's fps must be a positive number, got {fps!r:.40}")
        if "frames" in video:
            frames = video["frames"]
            if not isinstance(frames, (list, tuple)):
                raise EdgevlError("a video's 'frames' must be a list of images")
            return _frames_clip(list(frames), float(fps) if fps else None, "the video")
        video = video.get("path", video.get("video"))
        if video is None:
            raise EdgevlError("a video given as a dict needs 'frames' (a list of images) or 'path'")
    if isinstance(video, (list, tuple)):
        return _frames_clip(list(video), None, "the video")
    if not isinstance(video, (str, Path)):
        raise EdgevlError(f"a video must be a file path, a folder of frames or a list of frames, not "
                          f"{type(video).__name__}")
    path = Path(video).expanduser()
    if not path.exists():
        raise EdgevlError(f"video not found: {path}")
    if path.is_dir():
        return _folder_clip(path, float(fps) if fps else None)
    clip = _pillow_clip(path, fps)
    return clip if clip is not None else _pyav_clip(path, fps)


@dataclass
class SampledVideo:
    frames: list            # uint8 [H, W, 3] per sampled frame (padded to whole temporal patches)
    indices: list
    source_fps: float | None
    video_size: tuple       # (height, width) of the source
    resized_size: tuple
    timestamps: list
    grid_thw: tuple         # (temporal patches, patch rows, patch cols)


def plan(clip: Clip, cfg: VideoConfig, fps: float | None = None, max_frames: int | None = None,
         max_pixels: int | None = None) -> tuple[np.ndarray, tuple[int, int]]:
    """The frames a clip gives (source indices) and their (height, width), from its header alone;
    a clip or option outside the limits is a one-line error."""
    if clip.total < cfg.temporal_patch_size:
        raise EdgevlError(f"{clip.name} has {clip.total} frame(s); a video needs at least "
                          f"{cfg.temporal_patch_size} (give a single picture as an image)")
    if clip.width * clip.height > MAX_FRAME_PIXELS or min(clip.width, clip.height) < 1:
        raise EdgevlError(f"{clip.name} has {clip.width}x{clip.height} frames, outside what is accepted "
                          f"(up to {MAX_FRAME_PIXELS} pixels); scale it down first")
    if clip.total / (clip.fps or UNKNOWN_FPS) > MAX_DURATION_S:
        raise EdgevlError(f"{clip.name} lasts over {MAX_DURATION_S // 3600} hours; cut it into shorter clips")
    for what, v in (("fps", fps), ("max_frames", max_frames), ("max_pixels", max_pixels)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
            raise EdgevlError(f"{what} must be a positive number, got {v!r:.40}")
    if max_frames is not None and int(max_frames) < cfg.temporal_patch_size:
        raise EdgevlError(f"max_frames must be at least {cfg.temporal_patch_size}, got {max_frames}")
    indices = sample_indices(clip.total, clip.fps, cfg, fps, None if max_frames is None else int(max_frames))
    th, tw = (video_smart_resize(len(indices), clip.height, clip.width, cfg,
                                 None if max_pixels is None else int(max_pixels))
              if cfg.do_resize else (clip.height, clip.width))
    if th % cfg.factor or tw % cfg.factor:
        raise EdgevlError(f"without resizing a video's sides must be multiples of {cfg.factor}; enable do_resize")
    return indices, (th, tw)


def load_video(video, cfg: VideoConfig, fps: float | None = None, max_frames: int | None = None,
               max_pixels: int | None = None) -> SampledVideo:
    """Decode, sample and resize a clip; only the sampled frames are ever held."""
    clip = open_clip(video)
    indices, (th, tw) = plan(clip, cfg, fps, max_frames, max_pixels)
    frames = []
    for _, im in clip.read(sorted(int(i) for i in indices)):
        if im.size != (clip.width, clip.height):
            raise EdgevlError(f"{clip.name}: its frames differ in size ({im.width}x{im.height} after "
                              f"{clip.width}x{clip.height}); give frames of one size")
        if (th, tw) != (im.height, im.width):
            im = im.resize((tw, th), resample=cfg.resample)
        frames.append(np.asarray(im, dtype=np.uint8))
    frames += [frames[-1]] * (-len(frames) % cfg.temporal_patch_size)
    grid = (len(frames) // cfg.temporal_patch_size, th // cfg.patch_size, tw // cfg.patch_size)
    return SampledVideo(frames, [int(i) for i in indices], clip.fps, (clip.height, clip.width), (th, tw),
                        timestamps(indices, clip.fps, cfg.temporal_patch_size), grid)
