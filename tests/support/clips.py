"""Video clips tests make up: GIFs written byte by byte (frames placed anywhere on a logical screen
of any size, cut short anywhere), an animated WebP claiming any canvas, an APNG, MP4 and raw MPEG
streams written with PyAV, and an MP4 with a byte slipped in after a box."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
from PIL import Image


def has_pyav() -> bool:
    """PyAV (the video extra) is importable."""
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True


def _lzw(pixels: list[int], min_size: int) -> bytes:
    """GIF image data without compression: a Clear code before every pixel keeps the code
    width at ``min_size + 1`` bits, which every decoder takes."""
    clear, end, width = 1 << min_size, (1 << min_size) + 1, min_size + 1
    acc = nbits = 0
    out = bytearray()
    for code in [c for p in pixels for c in (clear, p)] + [end]:
        acc |= code << nbits
        nbits += width
        while nbits >= 8:
            out.append(acc & 0xFF)
            acc >>= 8
            nbits -= 8
    if nbits:
        out.append(acc & 0xFF)
    blocks = b"".join(bytes([len(out[i:i + 255])]) + bytes(out[i:i + 255]) for i in range(0, len(out), 255))
    return bytes([min_size]) + blocks + b"\x00"


def gif_bytes(screen: tuple[int, int], frames, delay_cs: int | None = 10, trailer: bool = True) -> bytes:
    """A GIF of a ``screen`` (width, height) logical screen; ``frames``: (x, y, w, h) rectangles,
    each a solid colour of a 4-colour local palette, after a graphic control block giving
    ``delay_cs`` hundredths of a second (None: no control block)."""
    out = bytearray(b"GIF89a" + struct.pack("<HHBBB", *screen, 0, 0, 0))
    for k, (x, y, w, h) in enumerate(frames):
        if delay_cs is not None:
            out += b"\x21\xf9\x04\x00" + struct.pack("<H", delay_cs) + b"\x00\x00"
        out += b"\x2c" + struct.pack("<HHHHB", x, y, w, h, 0x81)     # a local palette of 4 colours
        out += bytes([0, 0, 0, 255, 0, 0, 0, 255, 0, 0, 0, 255])
        out += _lzw([k % 4] * (w * h), 2)
    return bytes(out + (b"\x3b" if trailer else b""))


def write_gif(path, screen, frames, **kw) -> str:
    Path(path).write_bytes(gif_bytes(screen, frames, **kw))
    return str(path)


def small_frames(n: int, w: int = 64, h: int = 48) -> list:
    """``n`` frames of noise (nothing compresses away, so every byte of a file matters)."""
    return [Image.fromarray(np.random.default_rng(i).integers(0, 255, (h, w, 3), dtype=np.uint8)) for i in range(n)]


def save_animation(path, frames, duration=100) -> str:
    """An animated GIF, WebP or PNG (by the suffix) through Pillow."""
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=duration, loop=0)
    return str(path)


def webp_with_canvas(path, width: int, height: int, n: int = 3) -> str:
    """An animated WebP of ``n`` small frames whose header claims a ``width`` x ``height`` canvas."""
    save_animation(path, small_frames(n, 16, 16), 100)
    data = bytearray(Path(path).read_bytes())
    at = data.index(b"VP8X") + 8 + 4          # after the chunk's size and its 4 bytes of flags
    data[at:at + 6] = (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    Path(path).write_bytes(bytes(data))
    return str(path)


def write_pyav(path, frames, codec="mpeg4", rate=10, fmt=None, rotation=None) -> str:
    """A clip written with PyAV (``fmt``: a container format, e.g. ``mpeg1video`` for a raw stream;
    ``rotation``: a display matrix turning the frames counterclockwise, as phones write)."""
    import av

    h, w = np.asarray(frames[0]).shape[:2]
    with av.open(str(path), "w", format=fmt) as c:
        s = c.add_stream(codec, rate=rate)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        if rotation is not None:
            s.set_display_rotation(rotation)
        for f in frames:
            for pkt in s.encode(av.VideoFrame.from_ndarray(np.asarray(f), format="rgb24")):
                c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)
    return str(path)


def byte_after_box(path, box: bytes, out) -> str:
    """A copy of an MP4 with one zero byte slipped in right after its first ``box`` box."""
    data = Path(path).read_bytes()
    start = data.index(box) - 4
    end = start + struct.unpack(">I", data[start:start + 4])[0]
    Path(out).write_bytes(data[:end] + b"\x00" + data[end:])
    return str(out)


def apng_header_bomb(path, width: int, height: int) -> str:
    """An APNG of 2 frames whose IHDR claims ``width`` x ``height`` (the pixel data is a few bytes:
    only a header read can refuse it before decoding)."""
    from support.files import png_chunk

    ctl = [png_chunk(b"fcTL", struct.pack(">IIIIIHHBB", k, width, height, 0, 0, 1, 10, 0, 0)) for k in range(2)]
    ihdr = png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    Path(path).write_bytes(b"\x89PNG\r\n\x1a\n" + ihdr
                           + png_chunk(b"acTL", struct.pack(">II", 2, 0)) + ctl[0] + png_chunk(b"IDAT", b"\x78\x9c")
                           + ctl[1] + png_chunk(b"fdAT", struct.pack(">I", 2) + b"\x78\x9c") + png_chunk(b"IEND", b""))
    return str(path)


def gif_cut_in_frame(path, n: int = 6, cut_frame: int = 2) -> str:
    """A GIF cut right after the image descriptor (and palette) of frame ``cut_frame`` (0-based),
    where its pixel data should start."""
    data = gif_bytes((24, 16), [(0, 0, 24, 16)] * n)
    starts = [i for i in range(len(data)) if data[i:i + 1] == b"\x2c" and data[i - 8:i - 5] == b"\x21\xf9\x04"]
    Path(path).write_bytes(data[:starts[cut_frame] + 10 + 12])
    return str(path)


def damaged_clips(folder, pyav: bool = True) -> dict:
    """name -> (path, a phrase its one-line refusal must hold): decompression bombs whose headers
    claim huge frames, and files cut short or with a byte slipped in."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    clips = {
        "gif-screen": (write_gif(folder / "screen.gif", (65535, 65535), [(0, 0, 8, 8)] * 4), "65535x65535"),
        "gif-frame-far-out": (write_gif(folder / "far.gif", (64, 64), [(0, 0, 8, 8), (60000, 60000, 8, 8)] * 2),
                              "60008x60008"),
        "webp-canvas": (webp_with_canvas(folder / "canvas.webp", 20000, 20000), "20000x20000"),
        "apng-canvas": (apng_header_bomb(folder / "canvas.png", 20000, 20000), "20000x20000"),
        "gif-cut": (gif_cut_in_frame(folder / "cut.gif"), "truncated"),
    }
    png = save_animation(folder / "whole.png", small_frames(6))
    Path(folder / "cut.png").write_bytes(Path(png).read_bytes()[:Path(png).stat().st_size // 2])
    clips["apng-cut"] = (str(folder / "cut.png"), "truncated")
    webp = save_animation(folder / "whole.webp", small_frames(6))
    Path(folder / "cut.webp").write_bytes(Path(webp).read_bytes()[:Path(webp).stat().st_size // 2])
    clips["webp-cut"] = (str(folder / "cut.webp"), "truncated")
    if pyav:
        mp4 = write_pyav(folder / "whole.mp4", small_frames(8))
        clips["mp4-byte-after-dinf"] = (byte_after_box(mp4, b"dinf", folder / "dinf.mp4"), "cannot be read as a video")
    return clips
