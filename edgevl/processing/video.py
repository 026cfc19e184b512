"""Video input for the Qwen3-VL vision tower (Qwen3.5, Qwen3.5-MoE, the Youtu MoE) in numpy + Pillow.

Follows transformers' ``Qwen3VLVideoProcessor`` and the model authors' prompt format
(docs/video.md):

1. the clip's frame count and frame rate are read first; ``fps`` frames per second are sampled
   (at least ``min_frames``, at most ``max_frames`` and the clip's own count) at
   ``linspace(0, total - 1, n).round()``;
2. one size for all frames: ``smart_resize`` over (frames, height, width), the pixel budget
   (``size.longest_edge``) shared by the sampled frames;
3. frames are decoded one at a time and only the sampled ones are kept, already resized (8-bit
   RGB, torch's uint8 antialiased bicubic), so a long clip never sits in memory; an odd count repeats the last frame;
4. two consecutive frames make one temporal patch; the prompt gets, per temporal patch,
   ``<{t:.1f} seconds>`` (the mean time of its first and last frame) and its own
   ``<|vision_start|><|video_pad|>... <|vision_end|>`` group.

Decoding: animated GIF/WebP/PNG (known by their first bytes; their count, rate and canvas read
from their blocks, nothing decoded) and folders of frames with Pillow; every other file (MP4, WebM,
MOV, MKV, raw MPEG streams ...) with PyAV (``pip install 'edgevl[video]'``). Every file is checked
where it is opened (a regular file; inside the server's allowed folder when it has one), frame
sizes are refused from headers before anything is decoded, and a damaged file of any kind is one
``EdgevlError`` line naming it.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
import stat
import struct
import threading
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from ..errors import EdgevlError
from .image import load_image, resize_torchvision
from .qwen_vl import read_fields, rescale_normalize

FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
UNKNOWN_FPS = 24.0            # transformers' assumption for a clip without a frame rate
MAX_DURATION_S = 4 * 3600     # longer clips are refused before decoding
MAX_FRAME_PIXELS = 8192 * 8192
# Pillow composes each frame of an animated GIF/WebP/PNG onto the whole canvas and holds about four
# canvases meanwhile (16 bytes a pixel: 8000x8000 took 800 MB and 30 s for 64 frames); 4096x4096
# keeps a decode near 250 MB
MAX_ANIMATION_PIXELS = 4096 * 4096
MAX_FPS = 1000.0              # frame rates above it (sampled or claimed by a file) are absurd
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
    given = (width, height)     # the message names the clip's own size, not the scaled one
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise EdgevlError(f"the video is {given[0]}x{given[1]}: its aspect ratio exceeds {MAX_ASPECT}:1; crop it "
                          "first")
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
    # (T, C, H, W), rescaled and normalized in transformers' fused float32 step
    x = rescale_normalize(frames.transpose(0, 3, 1, 2), cfg)
    gh, gw = h // p, w // p
    x = x.reshape(t, c, gh // m, m, p, gw // m, m, p).transpose(2, 5, 3, 6, 1, 0, 4, 7)
    return np.ascontiguousarray(x, np.float32).reshape(gh * gw, c * t * p * p)


# ---------------------------------------------------------------------------------------------
# options: what the API, the server and the chat accept, checked once in one place

OPTION_KEYS = ("fps", "max_frames", "max_pixels")


def check_options(options, names: dict | None = None) -> dict:
    """``video_options`` as keyword arguments of ``encode_video``: None or a dict of ``fps`` (a
    number above 0, at most ``MAX_FPS``), ``max_frames`` (a whole number, at least 2) and
    ``max_pixels`` (a whole number, at least 1); None values are left out (the checkpoint's own).
    ``names`` maps a key to what messages call it (e.g. ``--fps`` on the command line)."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise EdgevlError(f"video_options must be a dict such as {{'fps': 2, 'max_frames': 64}}, not "
                          f"{type(options).__name__}")
    unknown = [k for k in options if k not in OPTION_KEYS]
    if unknown:
        raise EdgevlError(f"video_options has unknown key(s) {', '.join(repr(k) for k in unknown)[:80]}; the keys "
                          "are fps, max_frames and max_pixels")
    names = names or {}
    out = {}
    for k, v in options.items():
        if v is not None:
            out[k] = (_rate(v, names.get(k, k)) if k == "fps"
                      else _whole(v, names.get(k, k), 2 if k == "max_frames" else 1))
    return out


def _rate(v, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 < v <= MAX_FPS:   # NaN fails too
        raise EdgevlError(f"{what} must be a positive number up to {MAX_FPS:g}, got {v!r:.40}")
    return float(v)


def _whole(v, what: str, least: int) -> int:
    whole = (not isinstance(v, bool) and isinstance(v, numbers.Real)
             and (isinstance(v, numbers.Integral) or math.isfinite(v) and v == math.floor(v)))  # 10**400: no float
    if not whole or v < least:
        raise EdgevlError(f"{what} must be at least {least} (a whole number), got {v!r:.40}")
    return int(v)


def _source_fps(x) -> float | None:
    """A frame rate read from a file, or None (unknown: 24 fps) when it is not a number in
    (0, MAX_FPS]: an infinite, NaN or absurdly high claim would put every frame at 0.0 s. A rate
    too slow to be real is kept: its clip then claims to last over 4 hours and is refused."""
    try:
        x = float(x)
    except (TypeError, ValueError, OverflowError, ZeroDivisionError):
        return None
    return x if 0 < x <= MAX_FPS else None


def _fps_from_durations(ms: list) -> float | None:
    """An animated image's rate: 1000 over the mean duration of its first frames (milliseconds)."""
    mean = sum(ms) / len(ms) if ms else 0
    return _source_fps(1000.0 / mean) if mean > 0 else None


# ---------------------------------------------------------------------------------------------
# sources: what a clip is and how its frames are read. A clip's count, rate and size come from
# its file's own headers, nothing decoded; then the chosen frames are decoded one at a time.


@dataclass
class Clip:
    """A clip's frame count, frame rate (None: unknown), size and a reader of chosen frames."""
    total: int
    fps: float | None
    width: int
    height: int
    read: object          # (sorted indices) -> iterator of (index, PIL RGB image)
    name: str = "the video"
    # decoding work per frame: a file decodes every frame up to the last sampled one ("file"; an
    # animation composes each onto the whole canvas, "animation"); a folder or list only the sampled
    decodes: str = "sampled"


@dataclass
class VideoFile:
    """A clip's file for ``open_clip``: a ``path`` (a file or a folder of frames), every file of
    which is checked where it is opened: a regular file and, with ``root``, inside that folder once
    symlinks are resolved (the server's allowed folder); or an open binary ``file`` with a
    descriptor, read from its start and left open (the server's unnamed temporary file).
    ``name``: what messages call it (the path by default)."""
    path: str | Path | None = None
    file: object = None
    root: str | Path | None = None
    name: str | None = None


class VideoTooCostly(EdgevlError):
    """A clip whose sampling would decode more than the caller's bound (``plan``'s ``max_decode``)."""


class OutsideFolder(EdgevlError):
    """A file of a clip lies outside the folder it must stay in (the server answers 403)."""


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
          (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"))


def _not_regular(name: str, mode: int) -> EdgevlError:
    kind = next((k for test, k in _KINDS if test(mode)), "not a file")
    return EdgevlError(f"{name} is not a regular file ({kind}); give a video file, or image files in a folder")


def _regular(path, root: Path | None, name: str, what: str = "video") -> str:
    """``path`` resolved, in one line refused unless it is a regular file (opening a FIFO waits
    for a writer forever; a device never ends) and, with ``root``, unless it lies inside ``root``;
    nothing is opened."""
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except FileNotFoundError:
        raise EdgevlError(f"{what} not found: {name}; check the path") from None
    except (OSError, ValueError) as e:        # a symlink loop, a NUL byte, no permission ...
        raise EdgevlError(f"{name} cannot be read ({getattr(e, 'strerror', None) or 'a bad path'}); check the path "
                          "and its permissions") from None
    if root is not None and not Path(real).is_relative_to(root):
        raise OutsideFolder(f"{name} leads outside the allowed folder (a symlink?); put the files themselves in it")
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(name, st.st_mode)
    return real


def open_regular(path, root: Path | None, name: str, what: str = "video"):
    """``path`` opened for reading, under ``_regular``'s rules, checked before opening and again on
    the open descriptor, whose own path is what is checked: neither a symlink nor a file swapped
    in meanwhile can lead out of ``root``."""
    real = _regular(path, root, name, what)
    try:
        fd = os.open(real, _OPEN_FLAGS)
    except OSError as e:
        raise EdgevlError(f"{name} cannot be opened ({e.strerror}); check the file and its permissions") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(name, st.st_mode)
        if root is not None:
            try:
                opened = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:           # no /proc (not Linux): the resolved path was checked above
                opened = real
            if not Path(opened).is_relative_to(root):
                raise OutsideFolder(f"{name} leads outside the allowed folder (a symlink?); put the files "
                                    "themselves in it")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


# regular files ignore O_NONBLOCK; it is there so that a FIFO swapped in after the check cannot block
_OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_NOFOLLOW", 0)
               | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))


def _opener(vf: VideoFile):
    """A function giving a fresh binary file of the clip, positioned at its start."""
    if vf.file is not None:
        fd = vf.file.fileno()

        def open_file():
            f = os.fdopen(os.dup(fd), "rb")      # its own object: closing it leaves the caller's open
            f.seek(0)
            return f
        return open_file
    root = None if vf.root is None else Path(os.path.realpath(vf.root))
    return lambda: open_regular(vf.path, root, vf.name)


def _truncated(name: str) -> EdgevlError:
    return EdgevlError(f"{name} is truncated or damaged (it ends inside a block); re-export or re-download it")


def _damaged(name: str, what: str) -> EdgevlError:
    return EdgevlError(f"{name} cannot be read: it is damaged ({what}); re-export or re-download it")


def _check_size(name: str, width: int, height: int, limit: int = MAX_FRAME_PIXELS) -> None:
    """Frames a decoder will hold, refused from the header: a decompression bomb never decodes."""
    if width * height > limit:
        what = " in an animated GIF/WebP/PNG" if limit == MAX_ANIMATION_PIXELS else ""
        raise EdgevlError(f"{name} has {width}x{height} frames, outside what is accepted (up to {limit} pixels"
                          f"{what}); scale it down first")


class _Reader:
    """Exact reads and skips of a file of known size; running out is a truncated file."""

    def __init__(self, f, name: str):
        self.f, self.name = f, name
        self.size = os.fstat(f.fileno()).st_size

    def read(self, n: int) -> bytes:
        b = self.f.read(n)
        if len(b) < n:
            raise _truncated(self.name)
        return b

    def skip(self, n: int) -> None:
        if self.f.seek(n, 1) > self.size:
            raise _truncated(self.name)

    def at_end(self) -> bool:
        return self.f.tell() >= self.size


def _gif_header(f, name: str) -> tuple:
    """(frames, fps, width, height) of a GIF from its blocks: colour tables and pixel data are
    skipped, never decoded (Pillow counts frames by compositing each onto the whole logical
    screen: an 18 kB file claiming an 8000x8000 screen took ~550 MB). A frame placed beyond the
    screen grows Pillow's canvas, so the largest extent is the size checked; a file cut inside a
    frame is refused, one missing only its trailer is not (as Pillow)."""
    r = _Reader(f, name)
    head = r.read(13)
    sw, sh = struct.unpack("<HH", head[6:10])
    if head[10] & 0x80:
        r.skip(3 << ((head[10] & 7) + 1))
    first, big, n, durations, delay = None, (sw, sh), 0, [], None
    while not r.at_end():
        tag = r.read(1)
        if tag == b";":
            break
        if tag == b"\x00":           # stray block terminators: skipped, as Pillow does
            continue
        if tag == b"!":
            label, k = r.read(1)[0], 0
            while size := r.read(1)[0]:
                data = r.read(size)
                if label == 0xF9 and k == 0 and size >= 3:     # graphic control: the frame's delay
                    delay = (data[1] | data[2] << 8) * 10
                k += 1
        elif tag == b",":
            x, y, w, h, flags = struct.unpack("<HHHHB", r.read(9))
            big = (max(big[0], x + w), max(big[1], y + h))
            first = first or big
            if flags & 0x80:
                r.skip(3 << ((flags & 7) + 1))
            r.read(1)                # LZW code size
            while size := r.read(1)[0]:
                r.skip(size)
            n += 1
            if len(durations) < 64:
                durations.append(delay or 0)
            delay = None
        else:
            raise _damaged(name, f"an unknown block at byte {r.f.tell() - 1}")
    if n == 0:
        raise _damaged(name, "no image in it")
    _check_size(name, *big, MAX_ANIMATION_PIXELS)
    return n, _fps_from_durations(durations), *(first or (sw, sh))


def _png_header(f, name: str) -> tuple:
    """(frames, fps, width, height) of a PNG / APNG from its chunk headers (pixel data skipped):
    the canvas from IHDR, the count from acTL (plus a default image Pillow shows first), delays
    from fcTL. Fewer frame controls than announced, or a chunk running past the end, is a
    truncated file."""
    r = _Reader(f, name)
    r.read(8)
    size = announced = None
    n, default, durations = 0, False, []
    while not r.at_end():
        length, kind = struct.unpack(">I4s", r.read(8))
        if r.f.tell() + length + 4 > r.size:
            raise _truncated(name)
        data = r.read(min(length, 32))
        r.skip(length - len(data) + 4)          # the rest and the CRC
        if kind == b"IHDR" and length >= 8:
            size = struct.unpack(">II", data[:8])
        elif kind == b"acTL" and length >= 8:
            announced = struct.unpack(">I", data[:4])[0]
        elif kind == b"fcTL" and length >= 26:
            num, den = struct.unpack(">HH", data[20:24])
            n += 1
            if len(durations) < 64:
                durations.append(num / (den or 100) * 1000)
        elif kind == b"IDAT" and n == 0 and announced is not None:
            default = True           # an image before the first frame control: Pillow's frame 0
        elif kind == b"IEND":
            break
    if size is None:
        raise _damaged(name, "no IHDR header")
    _check_size(name, *size, MAX_ANIMATION_PIXELS)
    if announced is None:
        return 1, None, *size
    if n < announced:
        raise EdgevlError(f"{name} is truncated: its header announces {announced} frames, {n} are there; "
                          "re-export or re-download it")
    return announced + default, _fps_from_durations(([0] if default else []) + durations), *size


def _webp_header(f, name: str) -> tuple:
    """(frames, fps, width, height) of a WebP from its RIFF chunks: the canvas from VP8X (before
    libwebp allocates it), the frames and their durations from ANMF; a chunk running past the end
    is a truncated file."""
    r = _Reader(f, name)
    r.read(12)
    canvas, n, durations, still = None, 0, [], False
    while not r.at_end():
        kind, length = struct.unpack("<4sI", r.read(8))
        if r.f.tell() + length > r.size:
            raise _truncated(name)
        if kind == b"VP8X" and length >= 10:
            d = r.read(10)
            canvas = 1 + int.from_bytes(d[4:7], "little"), 1 + int.from_bytes(d[7:10], "little")
            r.skip(length - 10)
        elif kind == b"ANMF" and length >= 16:
            d = r.read(16)
            n += 1
            if len(durations) < 64:
                durations.append(int.from_bytes(d[12:15], "little"))
            r.skip(length - 16)
        else:
            still = still or kind in (b"VP8 ", b"VP8L")
            r.skip(length)
        if length & 1 and not r.at_end():
            r.skip(1)                # chunks are padded to even sizes
    if canvas is not None:
        _check_size(name, *canvas, MAX_ANIMATION_PIXELS)
    total = n or int(still)
    return total, _fps_from_durations(durations), *(canvas or (0, 0))


_PILLOW = {"GIF": _gif_header, "PNG": _png_header, "WEBP": _webp_header}


def _sniff(head: bytes) -> str | None:
    """The animated-image format Pillow reads for a file (by its first bytes), else None: every
    other file goes to PyAV (Pillow would take a raw MPEG stream, a TIFF, ... for one picture)."""
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if head[:8] == b"\x89PNG\r\n\x1a\n":
        return "PNG"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    return None


def _file_clip(vf: VideoFile, fps: float | None) -> Clip:
    name = vf.name or str(vf.path)
    vf = VideoFile(vf.path, vf.file, vf.root, name)
    opener = _opener(vf)
    with opener() as f:
        try:
            fmt = _sniff(f.read(12))
            if fmt is not None:
                f.seek(0)
                total, rate, width, height = _PILLOW[fmt](f, name)
        except EdgevlError:
            raise
        except (OSError, struct.error, IndexError, ValueError):
            raise _truncated(name) from None
    if fmt is None:
        return _pyav_clip(opener, name, fps)
    return Clip(total, fps if fps is not None else rate, width, height, _pillow_reader(opener, fmt, name), name,
                "animation")


def _pillow_reader(opener, fmt: str, name: str):
    def read(indices):
        i = None
        try:
            with opener() as f, Image.open(f, formats=[fmt]) as src:
                for i in indices:
                    for j in range(src.tell() + 1, i + 1):   # frame by frame: each may cost a whole canvas
                        src.seek(j)
                        _check_caller()
                    if src.tell() != i:
                        src.seek(i)
                    yield i, src.convert("RGB")
        except (EdgevlError, DecodeCancelled):
            raise
        except MemoryError:
            raise EdgevlError(f"not enough memory to decode {name}; send a smaller video") from None
        except Exception:  # noqa: BLE001 - Pillow raises many types on damaged data (OSError, SyntaxError, ...)
            where = "" if i is None else f" at frame {i + 1}"
            raise EdgevlError(f"{name} cannot be decoded{where}: the file is damaged or truncated; re-export or "
                              "re-download it") from None
    return read


class _NoOtherFiles:
    """PyAV's opener for files a container names (HLS or concat playlists, ...): none is opened,
    so a clip reads its own bytes only, never another file or a URL; ``asked`` says one was named."""

    def __init__(self):
        self.asked = False

    def __call__(self, url, flags, options):
        self.asked = True
        raise PermissionError("a video may not open other files")


# a display matrix's counterclockwise turn -> the transpose that shows the frame as players do
UPRIGHT = {90: Image.Transpose.ROTATE_90, 180: Image.Transpose.ROTATE_180, 270: Image.Transpose.ROTATE_270}


def _rotation(opener) -> int:
    """How far the clip's display matrix turns its frames counterclockwise (0, 90, 180 or 270;
    other angles are not applied): phones store portrait video on its side with such a matrix,
    and players turn it upright. PyAV gives it per frame only, so the first frame is decoded."""
    import av

    with opener() as f, av.open(f, io_open=_NoOtherFiles()) as c:
        first = next(c.decode(video=0), None)
    turn = round(first.rotation) % 360 if first is not None else 0
    return turn if turn in UPRIGHT else 0


def _pyav_clip(opener, name: str, fps: float | None) -> Clip:
    try:
        import av
    except ImportError:
        raise EdgevlError(f"reading {Path(name).suffix or 'this'} video files needs PyAV: pip install "
                          "'edgevl[video]' (or give an animated GIF/WebP or a folder of frames)") from None

    others = _NoOtherFiles()

    def unreadable():
        if others.asked:
            return EdgevlError(f"{name} names other files (a playlist?), which are never opened; give the video "
                               "file itself")
        return EdgevlError(f"{name} cannot be read as a video (damaged, or not a format FFmpeg reads); check the "
                           "file")

    try:
        with opener() as f, av.open(f, io_open=others) as c:
            if not c.streams.video:
                # an MP4 cut short (a download that stopped) loses its index, which lists the streams
                raise EdgevlError(f"{name} has no video stream (audio only, or a file cut short: check that it "
                                  "plays)")
            s = c.streams.video[0]
            cc = s.codec_context
            if cc is None or not cc.width or not cc.height:
                raise unreadable()
            rate = s.average_rate or s.guessed_rate
            src_fps = _source_fps(rate) if rate else None
            total = int(s.frames or 0)
            coded = width, height = cc.width, cc.height
            _check_size(name, width, height)
            if total <= 0:      # containers without a frame count (WebM, raw streams): count packets
                total = sum(1 for pkt in c.demux(s) if pkt.size)
                announced = c.duration / 1e6 * src_fps if c.duration and src_fps else None
                if announced and total < 0.9 * announced - 2:
                    raise EdgevlError(f"{name} holds {total} frames but its header announces {announced:.0f}; "
                                      "the file is truncated")
        turn = _rotation(opener)
    except EdgevlError:
        raise
    except MemoryError:
        raise EdgevlError(f"not enough memory to read {name}; send a smaller video") from None
    except Exception:  # noqa: BLE001 - FFmpeg and PyAV raise many types on damaged files
        raise unreadable() from None
    if turn in (90, 270):   # a phone's portrait clip, stored on its side: sampled upright
        width, height = height, width

    def read(indices):
        want = iter(indices)
        nxt, i = next(want, None), None
        try:
            with opener() as f, av.open(f, io_open=_NoOtherFiles()) as c:
                for i, frame in enumerate(c.decode(video=0)):
                    if nxt is None:
                        return
                    _check_caller()
                    if i == nxt:
                        if (frame.width, frame.height) != coded:    # before converting it
                            raise EdgevlError(f"{name}: its frames differ in size ({frame.width}x{frame.height} "
                                              f"after {coded[0]}x{coded[1]}); give frames of one size")
                        img = frame.to_image()
                        if turn:
                            img = img.transpose(UPRIGHT[turn])
                        while nxt == i:   # a short clip may repeat an index
                            yield i, img
                            nxt = next(want, None)
        except (EdgevlError, DecodeCancelled):
            raise
        except MemoryError:
            raise EdgevlError(f"not enough memory to decode {name}; send a smaller video") from None
        except Exception:  # noqa: BLE001 - FFmpeg and PyAV raise many types on damaged files
            where = "" if i is None else f" at frame {i + 1}"
            raise EdgevlError(f"{name}: decoding failed{where}; the file is damaged or its codec is not "
                              "supported") from None
        if nxt is not None:
            raise EdgevlError(f"{name} ended before frame {nxt + 1} of the {total} its header announces; the file "
                              "is truncated")

    return Clip(total, fps if fps is not None else src_fps, width, height, read, name, "file")


# -- frames: a list, or a folder of image files


@dataclass
class _FrameFile:
    path: str
    name: str


def _frames_clip(frames: list, fps: float | None, name: str, root: Path | None = None) -> Clip:
    if not frames:
        raise EdgevlError(f"{name} has no frames; give at least 2 images")
    frames = [_frame_item(x, k, name) for k, x in enumerate(frames)]     # kinds checked now, nothing decoded
    width, height = _frame_size(frames[0], root)
    _check_size(name, width, height)

    def read(indices):
        for i in indices:
            yield i, _frame(frames[i], root, (width, height), name)

    return Clip(len(frames), fps, width, height, read, name)


def _frame_item(x, k: int, name: str):
    if isinstance(x, np.ndarray):
        if x.dtype != np.uint8 or x.ndim != 3 or x.shape[2] != 3:
            raise EdgevlError(f"frame {k + 1} of {name} is an array of {x.dtype} {list(x.shape)}; a frame given as "
                              "an array must be uint8 [height, width, 3]")
        return x
    if isinstance(x, Image.Image) or isinstance(x, _FrameFile):
        return x
    if isinstance(x, (str, os.PathLike)):
        p = os.path.expanduser(os.fspath(x))
        return _FrameFile(p, p)
    raise EdgevlError(f"frame {k + 1} of {name} is a {type(x).__name__}; frames are image paths, PIL images or "
                      "uint8 [height, width, 3] arrays")


_ROTATED = (5, 6, 7, 8)       # EXIF orientations that swap width and height


def _orientation(im: Image.Image) -> int:
    """The EXIF orientation from what the header holds (a PNG's own getexif would decode the image
    to look past its pixels), applied the same way to every frame."""
    try:
        return int(Image.Image.getexif(im).get(0x0112) or 1)
    except Exception:  # noqa: BLE001 - a broken EXIF block leaves the frame as it is
        return 1


def _open_frame(x: _FrameFile, root):
    """(file, PIL image) of a frame file, its header read (nothing decoded)."""
    f = open_regular(x.path, root, x.name, "frame")
    try:
        with warnings.catch_warnings():   # sizes are checked by the caller, in one line
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(f)
    except Image.DecompressionBombError:
        f.close()
        raise EdgevlError(f"{x.name} has over {2 * (Image.MAX_IMAGE_PIXELS or 0)} pixels, outside what is accepted "
                          f"(up to {MAX_FRAME_PIXELS} a frame); scale the frames down") from None
    except Exception:  # noqa: BLE001 - Pillow raises many types on damaged or unknown files
        f.close()
        raise EdgevlError(f"{x.name} is not a readable image (damaged, or not PNG/JPEG/WebP/BMP/GIF/TIFF); "
                          "re-export or remove it") from None
    return f, im


def _frame_size(x, root) -> tuple[int, int]:
    if isinstance(x, np.ndarray):
        return x.shape[1], x.shape[0]
    if isinstance(x, Image.Image):
        return x.size
    f, im = _open_frame(x, root)
    with f, im:
        w, h = im.size
        return (h, w) if _orientation(im) in _ROTATED else (w, h)


def _frame(x, root, size: tuple[int, int], clip_name: str) -> Image.Image:
    if isinstance(x, np.ndarray):
        return Image.fromarray(x)
    if isinstance(x, Image.Image):
        return load_image(x)
    f, im = _open_frame(x, root)
    with f, im:
        turn = _orientation(im)
        w, h = im.size
        if ((h, w) if turn in _ROTATED else (w, h)) != size:     # refused from the header, before decoding
            raise EdgevlError(f"{clip_name}: its frames differ in size ({x.name} is {w}x{h} after {size[0]}x"
                              f"{size[1]}); give frames of one size")
        try:
            im.load()
        except MemoryError:
            raise EdgevlError(f"not enough memory to decode {x.name}; scale the frames down") from None
        except Exception:  # noqa: BLE001 - truncated or corrupt data: OSError, SyntaxError, ...
            raise EdgevlError(f"{x.name} cannot be decoded: it is damaged or truncated; re-export or re-download "
                              "it") from None
        if turn in _TRANSPOSE:
            im = im.transpose(_TRANSPOSE[turn])
        return load_image(im)


_TRANSPOSE = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
              5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
              8: Image.Transpose.ROTATE_90}


def _name_key(name: str) -> tuple:
    """Numeric-aware order (``f2`` before ``f10``) for any mix of names: digit runs and text runs
    are tagged so that a number is never compared with text; the name itself breaks ties."""
    runs = re.findall(r"(\d+)|(\D+)", name)
    return tuple((0, int(d), d) if d else (1, 0, t) for d, t in runs) + ((2, 0, name),)


def _folder_clip(folder: Path, fps: float | None, name: str, root: Path | None) -> Clip:
    try:
        # hidden files are no frames: a viewer's thumbnail, macOS's ._ resource forks
        entries = [p for p in folder.iterdir() if p.suffix.lower() in FRAME_SUFFIXES and not p.name.startswith(".")]
    except OSError as e:
        raise EdgevlError(f"{name} cannot be listed ({e.strerror}); check its permissions") from None
    if not entries:
        hidden = " (hidden files, named with a leading dot, are skipped)" if any(
            p.name.startswith(".") and p.suffix.lower() in FRAME_SUFFIXES for p in folder.iterdir()) else ""
        raise EdgevlError(f"{name} holds no frame images ({', '.join(FRAME_SUFFIXES)}){hidden}; give a folder of "
                          "frames or a video file")
    files = [_FrameFile(str(p), os.path.join(name, p.name)) for p in sorted(entries, key=lambda p: _name_key(p.name))]
    for f in files:         # all refused now, before the request waits (and again where each is opened)
        _regular(f.path, root, f.name, "frame")
    return _frames_clip(files, fps, name, root)


def open_clip(video) -> Clip:
    """A clip from its header alone: a path (video file, animated GIF/WebP/PNG, folder of frames),
    a ``VideoFile``, a list of frames (paths / PIL images / uint8 arrays) or a uint8 [frames,
    height, width, 3] array, or ``{"frames": [...] or "path": ..., "fps": source frame rate}``."""
    fps = None
    if isinstance(video, dict):
        unknown = [k for k in video if k not in ("frames", "path", "video", "fps")]
        if unknown:
            raise EdgevlError(f"a video given as a dict has unknown key(s) {', '.join(map(repr, unknown))[:80]}; "
                              "its keys are frames or path, and fps")
        fps = video.get("fps")
        if fps is not None:
            fps = _rate(fps, "a video's fps")
        if "frames" in video:
            frames = video["frames"]
            if isinstance(frames, np.ndarray) and frames.ndim == 4:
                frames = list(frames)
            if not isinstance(frames, (list, tuple)):
                raise EdgevlError("a video's 'frames' must be a list of images")
            return _frames_clip(list(frames), fps, "the video")
        video = video.get("path", video.get("video"))
        if video is None:
            raise EdgevlError("a video given as a dict needs 'frames' (a list of images) or 'path'")
    if isinstance(video, np.ndarray) and video.ndim == 4:
        video = list(video)
    if isinstance(video, (list, tuple)):
        return _frames_clip(list(video), fps, "the video")
    if isinstance(video, (str, os.PathLike)):
        path = Path(os.path.expanduser(os.fspath(video)))
        video = VideoFile(path, name=str(path))
    if not isinstance(video, VideoFile):
        raise EdgevlError(f"a video must be a file path, a folder of frames, a list of frames (image paths, PIL "
                          f"images or uint8 [height, width, 3] arrays) or {{'frames': [...], 'fps': N}}, not "
                          f"{type(video).__name__}")
    if video.file is not None:
        return _file_clip(video, fps)
    name = video.name or str(video.path)
    root = None if video.root is None else Path(os.path.realpath(video.root))
    try:
        st = os.stat(video.path)
    except FileNotFoundError:
        raise EdgevlError(f"video not found: {name}") from None
    except (OSError, ValueError) as e:
        raise EdgevlError(f"{name} cannot be read ({getattr(e, 'strerror', None) or 'a bad path'}); check the path "
                          "and its permissions") from None
    if stat.S_ISDIR(st.st_mode):
        real = Path(os.path.realpath(video.path))
        if root is not None and not real.is_relative_to(root):
            raise OutsideFolder(f"{name} leads outside the allowed folder (a symlink?); put the files themselves "
                                "in it")
        return _folder_clip(real, fps, name, root)
    return _file_clip(VideoFile(video.path, None, video.root, name), fps)


class DecodeCancelled(Exception):
    """The caller gave up on the clip (a client that hung up) while its frames were decoded."""


_caller = threading.local()


@contextmanager
def cancel_when(gone):
    """Within this block, decoding on this thread stops with :class:`DecodeCancelled` as soon as
    ``gone()`` is true; it is asked after every frame decoded, sampled or not (reaching one
    sampled frame may take thousands)."""
    _caller.gone = gone
    try:
        yield
    finally:
        _caller.gone = None


def _check_caller() -> None:
    gone = getattr(_caller, "gone", None)
    if gone is not None and gone():
        raise DecodeCancelled()


@dataclass
class SampledVideo:
    frames: list            # uint8 [H, W, 3] per sampled frame (padded to whole temporal patches)
    indices: list
    source_fps: float | None
    video_size: tuple       # (height, width) of the source
    resized_size: tuple
    timestamps: list
    grid_thw: tuple         # (temporal patches, patch rows, patch cols)


@dataclass
class DecodedVideo:
    """A clip its caller decoded already (the server does, off the model's thread, so that one
    long clip does not stall every other request), with the digest of its file's bytes for the
    encoding cache (None: not cached)."""
    sampled: SampledVideo
    digest: str | None = None


# Decoding cost per pixel of a frame, relative to FFmpeg's (~1 gigapixel a second on a laptop core):
# Pillow composes each animation frame onto the whole canvas (0.41 s for a 4096x4096 one: ~25x)
DECODE_COST = {"file": 1, "sampled": 1, "animation": 25}


def _frames_decoded(clip: Clip, indices) -> int:
    """Frames decoding ``indices`` of ``clip`` goes through."""
    return int(max(indices)) + 1 if clip.decodes != "sampled" else len(indices)


def decode_work(clip: Clip, indices) -> int:
    """Pixels (in FFmpeg-frame equivalents) decoding ``indices`` of ``clip`` goes through."""
    return _frames_decoded(clip, indices) * clip.width * clip.height * DECODE_COST[clip.decodes]


def plan(clip: Clip, cfg: VideoConfig, fps: float | None = None, max_frames: int | None = None,
         max_pixels: int | None = None, max_decode: int | None = None) -> tuple[np.ndarray, tuple[int, int]]:
    """The frames a clip gives (source indices) and their (height, width), from its header alone;
    a clip or option outside the limits is a one-line error. ``max_decode``: the most decoding
    work (``decode_work``) accepted (the server's bound on what one request may cost)."""
    if clip.total < cfg.temporal_patch_size:
        raise EdgevlError(f"{clip.name} has {clip.total} frame(s); a video needs at least "
                          f"{cfg.temporal_patch_size} (give a single picture as an image)")
    if clip.width * clip.height > MAX_FRAME_PIXELS or min(clip.width, clip.height) < 1:
        raise EdgevlError(f"{clip.name} has {clip.width}x{clip.height} frames, outside what is accepted "
                          f"(up to {MAX_FRAME_PIXELS} pixels); scale it down first")
    if clip.total / (clip.fps or UNKNOWN_FPS) > MAX_DURATION_S:
        raise EdgevlError(f"{clip.name} lasts over {MAX_DURATION_S // 3600} hours; cut it into shorter clips")
    opts = check_options({"fps": fps, "max_frames": max_frames, "max_pixels": max_pixels})
    fps, max_frames, max_pixels = (opts.get(k) for k in OPTION_KEYS)
    if max_frames is not None and max_frames < cfg.temporal_patch_size:
        raise EdgevlError(f"max_frames must be at least {cfg.temporal_patch_size}, got {max_frames}")
    indices = sample_indices(clip.total, clip.fps, cfg, fps, max_frames)
    if max_decode is not None and decode_work(clip, indices) > max_decode:
        raise VideoTooCostly(
            f"{clip.name}: sampling it means decoding {_frames_decoded(clip, indices)} frames of "
            f"{clip.width}x{clip.height}"
            f"{' composed on the whole canvas' if clip.decodes == 'animation' else ''}, more than this server decodes "
            f"for one request (about {max_decode / 1e9:.3g} gigapixels); send a shorter or smaller clip")
    th, tw = (video_smart_resize(len(indices), clip.height, clip.width, cfg, max_pixels)
              if cfg.do_resize else (clip.height, clip.width))
    if th % cfg.factor or tw % cfg.factor:
        raise EdgevlError(f"without resizing a video's sides must be multiples of {cfg.factor}; enable do_resize")
    return indices, (th, tw)


def load_video(video, cfg: VideoConfig, fps: float | None = None, max_frames: int | None = None,
               max_pixels: int | None = None, max_decode: int | None = None) -> SampledVideo:
    """Decode, sample and resize a clip; only the sampled frames are ever held."""
    clip = open_clip(video)
    indices, (th, tw) = plan(clip, cfg, fps, max_frames, max_pixels, max_decode)
    frames = []
    for _, im in clip.read(sorted(int(i) for i in indices)):
        _check_caller()
        if im.size != (clip.width, clip.height):
            raise EdgevlError(f"{clip.name}: its frames differ in size ({im.width}x{im.height} after "
                              f"{clip.width}x{clip.height}); give frames of one size")
        frames.append(resize_torchvision(im, th, tw, cfg.resample))   # as transformers' torchvision resize
    frames += [frames[-1]] * (-len(frames) % cfg.temporal_patch_size)
    grid = (len(frames) // cfg.temporal_patch_size, th // cfg.patch_size, tw // cfg.patch_size)
    return SampledVideo(frames, [int(i) for i in indices], clip.fps, (clip.height, clip.width), (th, tw),
                        timestamps(indices, clip.fps, cfg.temporal_patch_size), grid)
