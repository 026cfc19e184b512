"""Image input shared by every processor, in numpy + Pillow (no torch).

* :func:`load_image`: decode to 8-bit RGB with the EXIF orientation, bounded against image
  bombs; :func:`data_url_bytes` and :func:`file_url_path` read the URLs images and videos come as.
* :func:`resize_uint8_antialias`: PyTorch's uint8 antialiased bilinear and bicubic kernels,
  bit-exact, and :func:`resize_pil_strips`, the same reading a PIL image in strips.
* :func:`resize_torchvision`: the resize transformers' torchvision image and video processors
  run for a processor config's ``resample`` code.

Each model's processor (``edgevl/models/youtu_vl/processing.py``, ``qwen_vl.py``) builds on these.
Numbers in brackets, e.g. [3.3], are sections of docs/models/youtu_vl.md, where these steps are
written down.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from edgevl.errors import EdgevlError

__all__ = ["load_image", "data_url_bytes", "file_url_path", "resize_uint8_antialias", "resize_pil_strips",
           "resize_torchvision", "exif_transpose", "MAX_IMAGE_PATCHES"]

# The largest per-image patch budget accepted (a 4096x4096 image at 16 px patches). Tested to run
# on this ncnn wheel; far larger budgets crashed ncnn (a segfault, not an error) and would take
# hours anyway.
MAX_IMAGE_PATCHES = 65536

# Temporary int32 accumulators in the resize are kept to about this many elements
# (4 bytes each), so memory stays flat whatever the image size.
_BLOCK_ELEMS = 1 << 21

_16BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")


# --------------------------------------------------------------------------------------------
# [3.1] Decode
# --------------------------------------------------------------------------------------------


def load_image(image) -> Image.Image:
    """Return ``image`` (a path, the bytes of an image file, or a PIL image) as a loaded 8-bit
    RGB PIL image.

    Conversion follows ``PIL.Image.convert("RGB")``, which is what HF does: alpha is dropped
    (not composited), palette/CMYK/greyscale/1-bit are expanded. One deliberate exception:
    16-bit greyscale ("I;16*" and "I", which is how Pillow opens 16-bit PNG/TIFF) is scaled
    with ``>> 8``; Pillow would clamp every sample above 255 to white.

    For paths and bytes the EXIF orientation is applied first, as ``transformers.image_utils.load_image``
    does; a PIL image passed in is used as it is, like the HF processor does.
    """
    if isinstance(image, Image.Image):
        try:
            image.load()  # a lazily opened image may still be truncated
        except Exception as e:  # noqa: BLE001 - PIL raises many types for bad data
            raise EdgevlError(
                f"Could not decode the image ({type(e).__name__}: {e}); re-save it as PNG or JPEG."
            ) from None
        return _to_rgb(image, "the image")
    if isinstance(image, str):
        image = local_path(image)   # a file:// URL, as a browser or a file manager copies it
        if is_data_url(image):   # as the server's image_url parts take it
            image = data_url_bytes(image)
        elif not image.strip():
            raise EdgevlError("The image path is empty; pass an image file's path.")
        elif scheme := url_scheme(image):
            raise EdgevlError(f"{scheme}:// URLs are not read here; download the image and give its path.")
    if isinstance(image, (str, os.PathLike)):
        return _open_path(Path(image))
    if isinstance(image, (bytes, bytearray, memoryview)):
        data = bytes(image)
        if not data:
            raise EdgevlError("The image is empty (0 bytes); pass the bytes of an image file.")
        return _decode(io.BytesIO(data), f"{len(data)} bytes of image data", "the image")
    raise EdgevlError(
        f"Unsupported image type {type(image).__name__}; pass a file path, the bytes of an image file or a "
        "PIL.Image.Image."
    )


def data_url_bytes(url: str, what: str = "image") -> bytes:
    """The bytes of a base64 ``data:`` URL (line-wrapped base64 tolerated); ``what`` ("image" or
    "video") names it in the one-line errors."""
    head, sep, data = url[5:].partition(",")
    if not sep or not head.lower().endswith(";base64"):
        example = "data:image/png;base64,..." if what == "image" else "data:video/mp4;base64,..."
        raise EdgevlError(f"{what} data: URLs must be base64 ({example})")
    try:
        return base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError):
        raise EdgevlError(f"the {what} data: URL is not valid base64") from None


def file_url_path(url: str) -> str:
    """The local path a ``file:`` URL names (percent-escapes decoded); one naming another host is
    a one-line error."""
    from urllib.parse import unquote, urlsplit

    u = urlsplit(url)
    if u.netloc not in ("", "localhost"):
        raise EdgevlError(f"file URL with host {u.netloc!r}: only local files are supported")
    return unquote(u.path)


def local_path(text: str) -> str:
    """``text`` as a local path: a ``file://`` URL's path, anything else as it is."""
    return file_url_path(text) if text.startswith("file://") else text


def is_data_url(text: str) -> bool:
    """Whether ``text`` is a ``data:`` URL (an image inline; the scheme in any case, as URLs allow)."""
    return text[:5].lower() == "data:"


def url_scheme(text: str) -> str | None:
    """The scheme of a URL (``https`` of ``https://...``); None for a path."""
    m = re.match(r"([A-Za-z][A-Za-z0-9+.-]+)://", text)
    return m.group(1) if m else None


def shorten(text, n: int = 200) -> str:
    """A user's string fit for a one-line message (a path may be a whole pasted data URL)."""
    text = str(text)
    return text if len(text) <= n else text[:n] + "..."


def _open_path(path: Path) -> Image.Image:
    try:
        found = path.exists()
    except OSError:   # a name too long to be a file's, say
        found = False
    if not found:
        raise EdgevlError(f"Image file not found: {shorten(path)}; check the path.")
    if path.is_dir():
        raise EdgevlError(f"Image path is a directory, not a file: {path}; pass an image file.")
    try:
        size = path.stat().st_size
    except OSError as e:
        raise EdgevlError(f"Cannot read image file {path} ({e.strerror}); check its permissions.") from None
    if size == 0:
        raise EdgevlError(f"Image file is empty (0 bytes): {path}; re-export or re-download it.")
    try:
        # Pillow does not close a file object it was given, and closing ours leaves the decoded
        # pixels alone: no copy of a huge image (Image.close() would free them).
        with open(path, "rb") as f:
            return _decode(f, str(path), str(path))
    except PermissionError:
        raise EdgevlError(f"Permission denied reading image file {path}; check its permissions.") from None
    except OSError as e:
        raise EdgevlError(f"Cannot read image file {path} ({e.strerror or e}); check the disk and the path.") from None


def _decode(f, name: str, shown: str) -> Image.Image:
    """Decode an image file's contents (``f``: a binary file object); ``name`` says which in
    errors ("photo.jpg", "1234 bytes of image data"), ``shown`` in the RGB conversion's."""
    try:
        with warnings.catch_warnings():
            # Images between Pillow's warning and error limits are fine for us: they are
            # downscaled by the patch budget [3.2] and the resize works in row blocks.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(f)
            im.load()  # decode now so truncated files fail here, not later
        return _to_rgb(exif_transpose(im), shown)
    except EdgevlError:
        raise
    except Image.DecompressionBombError as e:
        raise EdgevlError(_bomb_message(name, e)) from None
    except UnidentifiedImageError:
        raise EdgevlError(
            f"Not a readable image file: {name}; use PNG, JPEG, WebP, BMP, GIF or TIFF."
        ) from None
    except MemoryError:
        raise EdgevlError(f"Not enough memory to decode {name}; downscale the image first.") from None
    except Exception as e:  # noqa: BLE001 - truncated/corrupt data raises OSError, SyntaxError, ...
        raise EdgevlError(
            f"Could not decode image file {name} (truncated or corrupt: {e}); re-export or re-download it."
        ) from None


def exif_transpose(im: Image.Image) -> Image.Image:
    """EXIF orientation applied as transformers' load_image does, in place where possible (no
    second copy of a big image); a broken EXIF block leaves the image as it is."""
    try:
        ImageOps.exif_transpose(im, in_place=True)
    except Exception:  # noqa: BLE001 - a broken EXIF block must not stop decoding
        pass
    return im


def _bomb_message(path, err: Exception) -> str:
    nums = [int(n) for n in re.findall(r"\d+", str(err))]
    limit = 2 * Image.MAX_IMAGE_PIXELS if Image.MAX_IMAGE_PIXELS else None
    pixels = nums[0] if nums else None
    what = f"{pixels} pixels" if pixels is not None else "too many pixels"
    lim = f" (limit {limit} pixels)" if limit else ""
    return f"Image {path} is too large: {what}{lim}; downscale it before use."


def _to_rgb(im: Image.Image, name: str) -> Image.Image:
    if im.width <= 0 or im.height <= 0:
        raise EdgevlError(f"Image {name} has zero size ({im.width}x{im.height}); pass a non-empty image.")
    try:
        if im.mode == "RGB":
            return im
        if im.mode in _16BIT_MODES or im.mode == "I":
            a = np.asarray(im)
            if im.mode == "I":
                # Mode "I" is int32; Pillow uses it for 16-bit sources, so treat it as 16-bit.
                a = np.clip(a, 0, 65535)
            grey = (a.astype(np.uint32) >> 8).astype(np.uint8)
            return Image.fromarray(grey, mode="L").convert("RGB")
        with warnings.catch_warnings():
            # "Palette images with transparency ... should be converted to RGBA": we drop alpha
            # on purpose (HF converts straight to RGB), so the hint is noise.
            warnings.simplefilter("ignore", UserWarning)
            return im.convert("RGB")
    except Exception as e:  # noqa: BLE001 - e.g. unsupported mode conversion
        raise EdgevlError(
            f"Cannot convert image {name} from mode {im.mode!r} to RGB ({e}); re-save it as RGB PNG or JPEG."
        ) from None


# --------------------------------------------------------------------------------------------
# [3.3] Resize: PyTorch's uint8 antialiased kernels (bilinear, bicubic)
# --------------------------------------------------------------------------------------------

RESIZE_MODES = ("bilinear", "bicubic")

# Pillow's resample codes, as processor configs write them.
_NEAREST, _LANCZOS, _BILINEAR, _BICUBIC, _BOX, _HAMMING = range(6)
_RESAMPLE_NAMES = "0 nearest, 1 lanczos, 2 bilinear, 3 bicubic, 4 box, 5 hamming"


def _triangle(x: np.ndarray) -> np.ndarray:
    return np.maximum(1.0 - x, 0.0)


def _keys_cubic(x: np.ndarray) -> np.ndarray:
    """Keys' cubic with a = -0.5 on |x| (torch's antialiased bicubic filter; its non-antialiased
    path uses -0.75). Each polynomial is evaluated in upstream's operation order."""
    a = -0.5
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


_FILTERS = {"bilinear": (1.0, _triangle), "bicubic": (2.0, _keys_cubic)}


def _check_mode(mode: str) -> str:
    if mode not in _FILTERS:
        raise EdgevlError(f"Unknown resize mode {mode!r}; use one of {', '.join(RESIZE_MODES)}.")
    return mode


def _aa_int16_weights(in_size: int, out_size: int, mode: str = "bilinear"):
    """Tap indices [out, K], int16-valued weights [out, K] and the precision for one axis.

    Mirrors PyTorch's double-precision antialiased weights (align_corners=False, no explicit
    scale factor) and their int16 quantisation. The order of float operations matters for
    bit-exactness and is kept as in the upstream kernel. Compilers may fuse upstream's
    ``center +- support`` into FMAs; measured against torch, that only moves a window edge onto a
    tap whose weight is exactly 0, so no pixel changes.
    """
    half, filt = _FILTERS[mode]
    scale = in_size / out_size
    aa = scale >= 1.0
    support = half * scale if aa else half  # the filter widens by the scale when downscaling
    invscale = 1.0 / scale if aa else 1.0  # upstream multiplies by 1/scale, not divides
    ksize = int(math.ceil(support)) * 2 + 1

    center = scale * (np.arange(out_size, dtype=np.float64) + 0.5)
    # astype(int64) truncates toward zero, like the C++ static_cast
    xmin = np.maximum((center - support + 0.5).astype(np.int64), 0)
    xsize = np.minimum((center + support + 0.5).astype(np.int64), in_size) - xmin
    xsize = np.clip(xsize, 0, ksize)  # rounding can add one tap; upstream clips it
    j = np.arange(ksize, dtype=np.int64)
    taps = xmin[:, None] + j[None, :]
    x = (taps.astype(np.float64) - center[:, None] + 0.5) * invscale
    w = filt(np.abs(x))
    w[j[None, :] >= xsize[:, None]] = 0.0
    total = np.zeros(out_size, dtype=np.float64)
    for k in range(ksize):  # sequential sum, as upstream (np.sum would pair-wise reorder)
        total += w[:, k]
    nz = total != 0.0
    w[nz] /= total[nz, None]

    # Precision: the largest prec < 22 with round(wmax * 2^(prec+1)) < 2^15 [3.3].
    wmax = max(0.0, float(w[nz].max())) if nz.any() else 0.0
    prec = 0
    while prec < 22 and int(0.5 + wmax * (1 << (prec + 1))) < (1 << 15):
        prec += 1
    # Round half away from zero: bicubic has negative lobes, and C's (int) cast truncates.
    v = w * (1 << prec)
    wi = np.where(v < 0, v - 0.5, v + 0.5).astype(np.int32)

    kmax = max(1, int(xsize.max()))  # drop all-zero trailing tap columns: less work, same sums
    taps = np.minimum(taps[:, :kmax], in_size - 1)  # zero-weight taps may point past the edge
    return taps.astype(np.intp), wi[:, :kmax], prec


def _finish(acc: np.ndarray, prec: int) -> np.ndarray:
    np.right_shift(acc, prec, out=acc)  # arithmetic shift: floors negative sums, as C's >> does
    np.clip(acc, 0, 255, out=acc)
    return acc.astype(np.uint8)


def _horizontal(src: Callable[[int, int], np.ndarray], h: int, w: int, c: int, out_w: int,
                mode: str = "bilinear") -> np.ndarray:
    """Resize along width; ``src(r0, r1)`` yields uint8 rows [r1-r0, w, c]."""
    taps, wi, prec = _aa_int16_weights(w, out_w, mode)
    out = np.empty((h, out_w, c), dtype=np.uint8)
    rows = max(1, _BLOCK_ELEMS // max(1, max(w, out_w) * c))
    for r0 in range(0, h, rows):
        r1 = min(h, r0 + rows)
        n = r1 - r0
        # Put width first so each tap gathers whole contiguous rows (fast fancy indexing).
        blk = np.ascontiguousarray(src(r0, r1).transpose(1, 0, 2)).reshape(w, n * c)
        acc = np.full((out_w, n * c), 1 << (prec - 1), dtype=np.int32)  # +0.5 for rounding
        tmp = np.empty_like(acc)
        for k in range(taps.shape[1]):
            np.multiply(blk[taps[:, k]], wi[:, k, None], out=tmp)
            acc += tmp
        out[r0:r1] = _finish(acc, prec).reshape(out_w, n, c).transpose(1, 0, 2)
    return out


def _vertical(img: np.ndarray, out_h: int, mode: str = "bilinear") -> np.ndarray:
    h, w, c = img.shape
    taps, wi, prec = _aa_int16_weights(h, out_h, mode)
    flat = img.reshape(h, w * c)
    out = np.empty((out_h, w * c), dtype=np.uint8)
    rows = max(1, _BLOCK_ELEMS // max(1, w * c))
    for o0 in range(0, out_h, rows):
        o1 = min(out_h, o0 + rows)
        acc = np.full((o1 - o0, w * c), 1 << (prec - 1), dtype=np.int32)
        tmp = np.empty_like(acc)
        for k in range(taps.shape[1]):
            np.multiply(flat[taps[o0:o1, k]], wi[o0:o1, k, None], out=tmp)
            acc += tmp
        out[o0:o1] = _finish(acc, prec)
    return out.reshape(out_h, w, c)


def _resize_rows(src, h: int, w: int, c: int, out_h: int, out_w: int, full=None,
                 mode: str = "bilinear") -> np.ndarray:
    # [3.3] step 1: horizontal pass first (if the width changes), stored as uint8, then vertical.
    if out_w != w:
        inter = _horizontal(src, h, w, c, out_w, mode)
    else:
        inter = full() if full is not None else src(0, h)
    if out_h != h:
        return _vertical(np.ascontiguousarray(inter), out_h, mode)
    return np.array(inter, dtype=np.uint8, copy=True) if out_w == w else inter


def _as_uint8_hwc(array_hwc_uint8, what: str) -> np.ndarray:
    a = np.asarray(array_hwc_uint8)
    if a.dtype != np.uint8 or a.ndim not in (2, 3) or min(a.shape) < 1:
        raise EdgevlError(
            f"{what} needs a non-empty uint8 [H, W, C] array, got dtype {a.dtype} "
            f"with shape {a.shape}; convert with np.asarray(img, dtype=np.uint8)."
        )
    return a


def _check_out_size(shape, out_h, out_w) -> tuple[int, int]:
    out_h, out_w = int(out_h), int(out_w)
    if out_h < 1 or out_w < 1:
        raise EdgevlError(f"Cannot resize shape {tuple(shape)} to {out_h}x{out_w}; all sizes must be >= 1.")
    return out_h, out_w


def resize_uint8_antialias(array_hwc_uint8: np.ndarray, out_h: int, out_w: int,
                           mode: str = "bilinear") -> np.ndarray:
    """Antialiased bilinear or bicubic resize of a uint8 [H, W, C] (or [H, W]) array.

    Bit-exact with ``torch.nn.functional.interpolate(x, size=(out_h, out_w), mode=mode,
    antialias=True, align_corners=False)`` on a uint8 tensor on CPU (the kernel torch takes on
    x86 CPUs with AVX2, which is what HF's torchvision processors run [3.3]): separable int16
    fixed-point filter (a triangle, or Keys' cubic with a = -0.5), horizontal pass first, a
    uint8 intermediate clamped to 0..255, then the vertical pass. Works in row blocks with
    int32 accumulators.
    """
    mode = _check_mode(mode)
    a = _as_uint8_hwc(array_hwc_uint8, "resize_uint8_antialias")
    squeeze = a.ndim == 2
    if squeeze:
        a = a[:, :, None]
    h, w, c = a.shape
    out_h, out_w = _check_out_size(np.shape(array_hwc_uint8), out_h, out_w)
    out = _resize_rows(lambda r0, r1: a[r0:r1], h, w, c, out_h, out_w, mode=mode)
    return out[:, :, 0] if squeeze else out


def resize_pil_strips(im: Image.Image, out_h: int, out_w: int, mode: str = "bilinear") -> np.ndarray:
    """Same as :func:`resize_uint8_antialias` on ``np.asarray(im)``, reading the RGB PIL image
    in row strips so a huge image never exists twice in memory."""
    mode = _check_mode(mode)
    w, h = im.size
    return _resize_rows(
        lambda r0, r1: np.asarray(im.crop((0, r0, w, r1))),
        h, w, 3, out_h, out_w,
        full=lambda: np.asarray(im),
        mode=mode,
    )


# --------------------------------------------------------------------------------------------
# The resize of transformers' torchvision processors, by Pillow resample code
# --------------------------------------------------------------------------------------------


def _resample_code(resample) -> int:
    try:
        code = int(resample)  # a plain int or PIL's Resampling enum
    except (TypeError, ValueError):
        code = -1
    if isinstance(resample, bool) or code != resample or not 0 <= code <= 5:
        raise EdgevlError(f"Unsupported resample value {resample!r}; use a Pillow code ({_RESAMPLE_NAMES}).")
    return code


def _nearest_exact_index(in_size: int, out_size: int, small: bool) -> np.ndarray:
    """Source index per output of torch's uint8 ``nearest-exact`` (what transformers runs for
    Pillow's NEAREST), in float32 as upstream computes it. Upstream has two kernels: small
    outputs (height + width <= 128) take floor(float((i + 0.5) * scale)); larger ones take
    floor(max(scale * (i + 0.5) - 0.5, 0) + 0.5), whose multiply-subtract x86 builds compile to
    one FMA (a CPU without FMA may pick the neighbouring pixel on exact ties)."""
    scale = np.float32(in_size) / np.float32(out_size)
    if small:
        pos = ((np.arange(out_size, dtype=np.float64) + 0.5) * np.float64(scale)).astype(np.float32)
        idx = np.floor(pos)
    else:
        d = np.arange(out_size, dtype=np.float32) + np.float32(0.5)
        # float32 * float32 is exact in float64, so one rounding to float32 here is the FMA's
        src = (np.float64(scale) * d.astype(np.float64) - 0.5).astype(np.float32)
        idx = np.floor(np.maximum(src, np.float32(0.0)) + np.float32(0.5))
    return np.minimum(idx.astype(np.int64), in_size - 1).astype(np.intp)


def _nearest_rows(src, h: int, w: int, c: int, out_h: int, out_w: int) -> np.ndarray:
    small = out_h + out_w <= 128
    ry, rx = _nearest_exact_index(h, out_h, small), _nearest_exact_index(w, out_w, small)
    out = np.empty((out_h, out_w, c), dtype=np.uint8)
    rows = max(1, _BLOCK_ELEMS // max(1, w * c))
    for r0 in range(0, h, rows):  # strips holding no sampled row are never read
        r1 = min(h, r0 + rows)
        sel = np.nonzero((ry >= r0) & (ry < r1))[0]
        if sel.size:
            out[sel] = src(r0, r1)[ry[sel] - r0][:, rx]
    return out


def resize_torchvision(image, out_h: int, out_w: int, resample) -> np.ndarray:
    """``image`` (an RGB PIL image, or a uint8 [H, W, C] / [H, W] array) resized to
    (out_h, out_w) as transformers' torchvision processors resize a uint8 tensor for the Pillow
    resample code ``resample`` of a processor config; a uint8 array back.

    * 3 (bicubic), 2 (bilinear): torch's uint8 antialiased kernels, bit-exact
      (:func:`resize_uint8_antialias`); PIL images are read in strips. torchvision resizes
      bicubic in uint8 on every CPU; bilinear only where torch reports AVX2, elsewhere
      it goes through float32 and may differ by 1 on some pixels.
    * 0 (nearest): torch's ``nearest-exact`` on uint8, the mode transformers maps NEAREST to.
    * 1 (lanczos), 4 (box), 5 (hamming): Pillow's filter of that name. torchvision's tensor
      resize has no box or hamming kernel (transformers' torchvision path fails on them), and
      for lanczos transformers runs bicubic or a torchvision kernel depending on its version, so
      these may differ from transformers.

    Same size in and out: the pixels unchanged, as torchvision returns them.
    """
    code = _resample_code(resample)
    if isinstance(image, Image.Image):
        if image.mode != "RGB":
            raise EdgevlError(f"resize_torchvision needs an RGB PIL image, got mode {image.mode!r}; "
                              "convert it with edgevl.processing.image.load_image first.")
        w, h = image.size
        c = 3
        strip = lambda r0, r1: np.asarray(image.crop((0, r0, w, r1)))  # noqa: E731
    else:
        a = _as_uint8_hwc(image, "resize_torchvision")
        h, w = a.shape[:2]
        c = a.shape[2] if a.ndim == 3 else 1
        strip = lambda r0, r1: a[r0:r1].reshape(r1 - r0, w, c)  # noqa: E731
    out_h, out_w = _check_out_size((h, w, c), out_h, out_w)
    squeeze = not isinstance(image, Image.Image) and np.ndim(image) == 2

    if (out_h, out_w) == (h, w):
        out = np.array(image, dtype=np.uint8)
    elif code in (_BILINEAR, _BICUBIC):
        mode = "bilinear" if code == _BILINEAR else "bicubic"
        out = _resize_rows(strip, h, w, c, out_h, out_w, full=lambda: strip(0, h), mode=mode)
    elif code == _NEAREST:
        out = _nearest_rows(strip, h, w, c, out_h, out_w)
    else:
        # Pillow's own lanczos / box / hamming: the filters these codes name (see above).
        out = _pillow_resize(image if isinstance(image, Image.Image) else strip(0, h), out_h, out_w, code)
    if out.ndim == 2 and not squeeze:
        out = out[:, :, None]
    return out[:, :, 0] if squeeze and out.ndim == 3 else out


def _pillow_resize(image, out_h: int, out_w: int, code: int) -> np.ndarray:
    if not isinstance(image, Image.Image):
        try:
            image = Image.fromarray(image[:, :, 0] if image.shape[2] == 1 else image)
        except (TypeError, ValueError):
            raise EdgevlError(f"Pillow cannot resize a {image.shape[2]}-channel array (resample {code}); "
                              "pass 1, 3 or 4 channels or resample 0, 2 or 3.") from None
    return np.asarray(image.resize((out_w, out_h), resample=code), dtype=np.uint8)
