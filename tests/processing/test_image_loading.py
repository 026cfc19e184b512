"""Loading images (edgevl.processing.image.load_image, and Youtu-VL's preprocess on top): missing,
empty, garbage and truncated files, every PIL mode, 16-bit grey, EXIF orientation, decompression
bombs refused, huge images downscaled within the patch budget (docs/models/youtu_vl.md section
3.1)."""

import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from edgevl.errors import EdgevlError
from edgevl.models.youtu_vl.processing import preprocess, target_size
from edgevl.processing.image import load_image
from support.common import noise_pixels
from support.files import png_chunk


def test_missing_path_directory_empty_and_garbage(tmp_path):
    with pytest.raises(EdgevlError, match="not found"):
        load_image(tmp_path / "nope.png")
    with pytest.raises(EdgevlError, match="directory"):
        load_image(tmp_path)
    empty = tmp_path / "empty.jpg"
    empty.write_bytes(b"")
    with pytest.raises(EdgevlError, match="empty"):
        load_image(empty)
    junk = tmp_path / "junk.png"
    junk.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(EdgevlError, match="Not a readable image"):
        preprocess(junk)
    with pytest.raises(EdgevlError, match="Unsupported image type"):
        load_image(123)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_truncated_file(tmp_path, fmt):
    p = tmp_path / f"t.{fmt.lower()}"
    Image.fromarray(noise_pixels(200, 300, seed=4)).save(p, fmt)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(EdgevlError, match="truncated or corrupt"):
        load_image(p)
    # a truncated image handed over as a lazily opened PIL image is caught too
    with Image.open(p) as im:
        with pytest.raises(EdgevlError, match="decode"):
            load_image(im)


def test_small_image_is_stretched_to_32():
    out = preprocess(Image.new("RGB", (10, 5), (10, 200, 30)))
    assert out["resized_size"] == (32, 32) and out["spatial_shapes"] == (2, 2)
    assert out["pixel_values"].shape == (4, 768) and out["num_image_tokens"] == 1
    assert np.array_equal(out["pixel_values"][0, :3], (np.float32([10, 200, 30]) - 127.5) / np.float32(127.5))


def test_zero_size_image():
    with pytest.raises(EdgevlError, match="zero size"):
        load_image(Image.new("RGB", (0, 5)))


@pytest.mark.parametrize("mode", ["RGBA", "LA", "L", "1", "P", "PA", "CMYK", "YCbCr"])
def test_modes_convert_like_pil(mode):
    base = Image.fromarray(noise_pixels(20, 30, seed=8))
    src = base.convert("RGBA") if mode in ("RGBA",) else base.convert(mode)
    if mode == "RGBA":
        src.putalpha(Image.fromarray(noise_pixels(20, 30, seed=9)[:, :, 0]))
    if mode == "P":
        src.info["transparency"] = 0
    out = load_image(src)
    assert out.mode == "RGB" and out.size == (30, 20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = np.asarray(src.convert("RGB"))
    assert np.array_equal(np.asarray(out), expected)  # alpha dropped, not composited


def test_16bit_grey_is_scaled_down(tmp_path):
    v = (np.arange(16 * 64, dtype=np.uint16).reshape(16, 64) * 64).astype(np.uint16)
    im16 = Image.fromarray(v)
    assert im16.mode == "I;16"
    expected = np.repeat((v >> 8).astype(np.uint8)[:, :, None], 3, axis=2)
    assert np.array_equal(np.asarray(load_image(im16)), expected)
    assert np.array_equal(np.asarray(load_image(im16.convert("I"))), expected)
    p = tmp_path / "g16.png"
    im16.save(p)
    assert np.array_equal(np.asarray(load_image(p)), expected)


def test_exif_orientation_applied_for_paths(tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees on display
    p = tmp_path / "o.jpg"
    Image.new("RGB", (40, 20), (50, 60, 70)).save(p, exif=exif)
    assert load_image(p).size == (20, 40)


def test_image_file_bytes_load_as_the_file_does(tmp_path):
    """Bytes of an image file (a table's image column, an API caller's) decode as that file:
    the same pixels, the EXIF orientation applied, and bad bytes the same one-line errors."""
    p = tmp_path / "n.png"
    Image.fromarray(noise_pixels(30, 50, seed=7)).save(p)
    assert np.array_equal(np.asarray(load_image(p.read_bytes())), np.asarray(load_image(p)))
    exif = Image.Exif()
    exif[0x0112] = 6
    o = tmp_path / "o.jpg"
    Image.new("RGB", (40, 20), (50, 60, 70)).save(o, exif=exif)
    assert load_image(bytearray(o.read_bytes())).size == (20, 40)
    with pytest.raises(EdgevlError, match="empty"):
        load_image(b"")
    with pytest.raises(EdgevlError, match="Not a readable image file: 4 bytes of image data"):
        load_image(b"junk")
    with pytest.raises(EdgevlError, match="truncated or corrupt"):
        load_image(p.read_bytes()[:200])
    bomb = tmp_path / "bomb.png"
    _png_header_only(bomb, 20000, 10000)
    with pytest.raises(EdgevlError, match="too large: 200000000 pixels"):
        load_image(bomb.read_bytes())


def _png_header_only(path: Path, w: int, h: int):
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IEND", b""))


def test_decompression_bomb_is_a_clear_error(tmp_path):
    p = tmp_path / "bomb.png"
    _png_header_only(p, 20000, 10000)  # 200 Mpx, over Pillow's hard limit
    with pytest.raises(EdgevlError, match=r"too large: 200000000 pixels \(limit \d+ pixels\)"):
        load_image(p)


def test_huge_image_is_downscaled_within_budget(tmp_path):
    # 12000x9000 = 108 Mpx: above Pillow's warning limit, below its error limit. Solid colour
    # keeps the PNG tiny and the encode fast.
    p = tmp_path / "huge.png"
    Image.new("L", (12000, 9000), 77).save(p, compress_level=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        out = preprocess(p)
    gh, gw = out["spatial_shapes"]
    assert out["image_size"] == (9000, 12000)
    assert gh * gw <= 36864 and out["resized_size"] == target_size(9000, 12000)
    assert np.all(out["pixel_values"] == (np.float32(77) - 127.5) / np.float32(127.5))


def test_a_file_url_loads_as_its_path(tmp_path):
    p = tmp_path / "with space é.png"
    Image.fromarray(noise_pixels(30, 50, seed=8)).save(p)
    assert np.array_equal(np.asarray(load_image(p.as_uri())), np.asarray(load_image(p)))
    with pytest.raises(EdgevlError, match="Image file not found"):
        load_image((tmp_path / "gone.png").as_uri())
