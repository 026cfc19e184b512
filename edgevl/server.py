"""OpenAI-compatible HTTP server on the standard library (``edgevl serve MODEL``).

    POST /v1/chat/completions   JSON, or Server-Sent Events with "stream": true
    GET  /v1/models[/ID]        the one model this server runs
    GET  /health                liveness, no API key needed
    GET  /                      the chat page (edgevl/web; its files need no key, the API does)
    GET  /props                 what the model takes and its defaults, for the page
    GET  /metrics               Prometheus metrics: requests, tokens, latencies, memory

Design:
- ``ThreadingHTTPServer``: a thread per connection, so /health, errors and 429s answer while
  generations run. Requests decode together in the engine's slots (``edgevl.engine``: a slot
  keeps its sequence's cache, which also gives prefix reuse across requests that resend a
  conversation); at most ``max_queue`` requests wait for a slot and the next ones get 429 at once
  instead of piling up. ``n`` answers to one request are that many requests of the engine.
- Every client mistake is a JSON error in OpenAI's shape and the connection stays usable (or
  is closed when its body was not read); bodies over ``max_body`` get 413 before being read.
- Images: ``data:`` URLs (base64) always; local paths only under ``--allow-image-dir``
  (symlinks and ``..`` resolved first); ``http(s)://`` URLs are never fetched. Before a request
  queues, each image is checked from its header only (format, pixel count within
  ``MAX_IMAGE_PIXELS`` per request, fit to the patch budget); its pixels are decoded only once
  the request holds the model, so memory holds one request's images however many wait.
- A client that hangs up is noticed between tokens (and while queued), and its generation stops.
  A client that only closes its sending side (``nc -N``, some proxies) still reads its answer: a
  small write (an interim 100 response, or an SSE comment) tells the two apart.
- A prompt the context cannot hold is refused before it queues: from its rendered length alone
  when no tokenization could bring it under the context, else from its token count, taken piece
  by piece outside the model lock (bounded memory, the GIL released), so a 20 MB message costs
  neither the model nor /health seconds.
- Faults of the server's side (the package failing under the running model, a bug) are a 500 in
  one line, or a final error event in a stream, and one log line (a bug's traceback too).
- Message contents are plain text: special-token text in them does not become control tokens
  (``allow_special_in_content`` restores that).
- Sampling defaults are the model's (its generation_config.json, else greedy; up to the context
  end), not OpenAI's temperature 1; ``top_k`` and ``repetition_penalty`` are accepted as
  extensions; ``temperature: 0`` is plain greedy. ``presence_penalty`` and ``frequency_penalty``
  count the tokens the answer has generated, as OpenAI's; ``logprobs`` are the model's own
  (before penalties, temperature and masks); ``min_p`` and ``logit_bias`` are taken as well.
- Model names: the one model answers to any requested name (clients often send a fixed one), as
  llama-server does, unless ``strict_model``. Boxes the answer names come back as an extra
  ``boxes`` field of the message (streaming: of the last delta), in original-image pixels. ``usage.completion_tokens``
  counts every generated token, the end-of-text token included.
- Models that think first (reasoning markers such as ``<think>``): the thinking comes back as
  ``message.reasoning_content`` (streaming: ``delta.reasoning_content``), apart from ``content``,
  as vLLM and llama-server do; ``chat_template_kwargs`` (e.g. ``{"enable_thinking": false}``)
  reaches the chat template, over the server's own defaults (``edgevl serve --no-thinking``).
- Structured output (``edgevl.structured``): ``response_format`` json_object / json_schema as
  OpenAI's, and, as vLLM's extension, ``structured_outputs`` ``{"json" | "regex" | "choice" |
  "grammar": ...}`` (also its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
  ``guided_grammar``). Each is checked and compiled before the request queues (a bad schema or
  grammar is a 400 in one line); compiled grammars are cached, a bounded number.
- Tools (``edgevl.tools``; models whose chat template has a call format):
  ``tools`` are rendered by the template, calls come back as ``message.tool_calls`` (streamed:
  ``delta.tool_calls``, name first, then argument fragments) with ``finish_reason`` "tool_calls";
  ``tool_choice`` "required" or a named function constrains the answer to calls. Other models
  refuse ``tools`` with a 400 naming the family, rather than ignore them.
"""

from __future__ import annotations

import ctypes
import errno
import hmac
import io
import ipaddress
import json
import math
import re
import select
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
import warnings
from collections import deque
from contextlib import contextmanager, suppress
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import chain
from pathlib import Path
from urllib.parse import unquote, urlsplit

from . import __version__, responses, structured
from . import tools as tool_calls
from .errors import EdgevlError, PackageError, ShuttingDown
from .generate import MAX_CHOICES, encode_messages, model_template_kwargs, stop_strings, stream_choices
from .metrics import Registry, process_metrics
from .model import Model, load
from .processing.image import data_url_bytes, file_url_path
from .processing.video import OutsideFolder, VideoTooCostly, open_regular
from .sample import MAX_TOP_LOGPROBS, check_logit_bias, check_setting, finite_number

MAX_BODY = 20 << 20             # request bytes; a base64 image is 4/3 of its file size
MAX_IMAGE_PIXELS = 100_000_000  # per request, all images (~400 MB decoded); the patch budget shrinks them later
# Peak bytes per pixel of decoding an image and making it RGB (measured on 100-megapixel images:
# Pillow's WebP decoder holds ~15, a 16-bit RGBA PNG ~8), and what requests' decoded images may
# hold at once: past it a request waits for the others' to go before decoding (one alone may go past it)
DECODE_BYTES = {"WEBP": 16, None: 8}
DECODE_BUDGET = 1 << 30
MAX_VIDEO_DECODE_GPX = 64.0   # one request's video decoding, in gigapixels of frames (~a minute of FFmpeg on a core)
IDLE_TIMEOUT = 120              # seconds a silent client may hold its connection thread
STALLED_STREAM = 60             # seconds a stream's write may wait (nginx's send_timeout): then the client is gone
CUT_ANSWER_SECONDS = 3.0        # at a stop, for requests cut short to be told so (503) before exiting
PIECE = 1 << 15                 # characters tokenized at a time to count a prompt: bounds the memory it takes
NO_TOOLS = "tools go in the request's tools field, not in chat_template_kwargs; send them there"


class HTTPError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
             429: "rate_limit_error", 500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.param, self.code, self.headers = status, param, code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


class Gate:
    """``slots`` generations at a time (the engine's); at most ``max_queue`` requests wait for
    one, more get 429. Waiters are served in arrival order, and a newcomer never takes a slot
    ahead of them: under steady load no request waits while later ones go through."""

    def __init__(self, max_queue: int, slots: int = 1):
        self.max_queue, self.slots = max_queue, slots
        self.held = 0       # requests holding a slot
        self._cond = threading.Condition()
        self._queue: deque = deque()   # the waiters' tickets, oldest first

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @contextmanager
    def __call__(self, gone=lambda: False):
        """``gone()`` is polled while waiting: a client that hung up gives its place back."""
        with self._cond:
            if self.held < self.slots and not self._queue:
                self.held += 1
            else:
                if len(self._queue) >= self.max_queue:
                    raise HTTPError(429, f"the server is busy ({len(self._queue)} requests already waiting); retry "
                                    "shortly", code="queue_full", headers={"Retry-After": "1"})
                ticket = object()
                self._queue.append(ticket)
                try:
                    while self._queue[0] is not ticket or self.held >= self.slots:
                        self._cond.wait(0.25)
                        self._cond.release()   # gone() may write to the client: not with the gate held
                        try:
                            hung_up = gone()
                        finally:
                            self._cond.acquire()
                        if hung_up:
                            raise ConnectionError("the client hung up while queued")
                except BaseException:
                    self._queue.remove(ticket)
                    self._cond.notify_all()   # the one behind it may be first now
                    raise
                self._queue.popleft()
                self.held += 1
                self._cond.notify_all()   # with several free slots the next waiter may go too
        try:
            yield
        finally:
            with self._cond:
                self.held -= 1
                self._cond.notify_all()

    def locked(self) -> bool:
        """Whether a request holds a slot."""
        return self.held > 0


# -- request parsing (no model access: runs outside the lock) ----------------------------------

class MemoryBudget:
    """Bytes that requests' decoded images may hold at once: a request whose images would go past
    it waits (holding its slot) until others give theirs back; one alone always goes, so a single
    image larger than the budget is served, never starved. Held from decoding to the end of the
    request, as long as its images live."""

    def __init__(self, limit: int):
        self.limit, self.used = int(limit), 0
        self._cond = threading.Condition()

    @contextmanager
    def hold(self, cost: int, gone=lambda: False):
        with self._cond:
            while self.used and self.used + cost > self.limit:
                self._cond.wait(0.25)
                if gone():
                    raise ConnectionAbortedError("the client hung up while waiting to decode its images")
            self.used += cost
        try:
            yield
        finally:
            with self._cond:
                self.used -= cost
                self._cond.notify_all()


def decode_cost(messages: list) -> int:
    """The bytes decoding a request's pending images may peak at (``DECODE_BYTES``)."""
    return sum(p["image"].cost for m in messages if isinstance(m.get("content"), list)
               for p in m["content"] if p.get("type") == "image" and isinstance(p.get("image"), PendingImage))


def _number(req: dict, name: str, default, kind=float):
    v = req.get(name)
    if v is None:
        return default
    if not finite_number(v) or (kind is int and not float(v).is_integer()):   # no bool, no 400-digit integer
        raise HTTPError(400, f"{name} must be {'an integer' if kind is int else 'a number'}, got {v!r:.40}", name)
    return kind(v)


def _setting(req: dict, name: str, kind=float):
    """A sampling setting (None: the model's), in its range (``sample.SETTINGS``)."""
    v = _number(req, name, None, kind)
    if name == "top_k" and v == -1:   # vLLM's (and llama-server's) "every token": top-k off
        v = 0
    if v is not None:
        try:
            check_setting(name, v)
        except EdgevlError as e:
            raise HTTPError(400, str(e), name) from None
    return v


def _readable(conn) -> bool:
    """Whether a socket has input waiting (or its end), without blocking. poll, not select: select
    cannot take descriptors past 1024, which a server holding many idle connections hands out."""
    p = select.poll()
    p.register(conn, select.POLLIN)
    return bool(p.poll(0))


def _too_many_pixels(param: str) -> HTTPError:
    return HTTPError(400, f"the request's images have more than {MAX_IMAGE_PIXELS} pixels in all; send smaller "
                     "images", param, "image_too_large")


def _undecodable(e: Exception, param: str) -> HTTPError:
    from PIL import UnidentifiedImageError

    if isinstance(e, UnidentifiedImageError):  # its message names a BytesIO object, not the problem
        return HTTPError(400, "the image data is not an image in a format this server reads; send PNG, JPEG, "
                         "WebP, BMP, GIF or TIFF", param, "invalid_image")
    why = str(e).splitlines()[0] if str(e) else ""
    return HTTPError(400, f"the image could not be decoded ({type(e).__name__}: {why}); send PNG, JPEG, WebP, BMP, "
                     "GIF or TIFF", param, "invalid_image")


class PendingImage:
    """An image known from its header only (format, size): cheap to hold while the request
    waits. ``decode()`` reads the pixels; the server calls it once the request holds the model."""

    def __init__(self, opener, param: str, shown: str | None = None):
        from PIL import Image

        self.opener, self.param, self.shown = opener, param, shown
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own limit applies
                im = opener()
                self.width, self.height = im.width, im.height
                self.cost = im.width * im.height * DECODE_BYTES.get(im.format, DECODE_BYTES[None])
                im.close()
        except Image.DecompressionBombError:
            raise _too_many_pixels(param) from None
        except HTTPError:
            raise
        except OutsideFolder as e:
            raise HTTPError(403, str(e), param, "image_path_forbidden") from None
        except EdgevlError as e:
            raise HTTPError(400, str(e), param, "invalid_image") from None
        except Exception as e:  # noqa: BLE001 - Pillow raises many types for bad data
            raise _undecodable(e, param) from None

    def decode(self):
        from PIL import Image

        from .processing.image import exif_transpose

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                im = self.opener()
                if (im.width, im.height) != (self.width, self.height):  # a local file changed meanwhile
                    raise _too_many_pixels(self.param)
                im.load()
            return exif_transpose(im)  # as for image files (and transformers' load_image)
        except HTTPError:
            raise
        except OutsideFolder as e:
            raise HTTPError(403, str(e), self.param, "image_path_forbidden") from None
        except MemoryError:
            raise HTTPError(400, "not enough memory to decode the image; send a smaller one", self.param,
                            "image_too_large") from None
        except Exception as e:  # noqa: BLE001 - truncated data raises OSError, SyntaxError, ...
            raise _undecodable(e, self.param) from None


def _image(url: str, server: EdgevlServer, param: str) -> PendingImage:
    """A pending image from an image_url: a base64 data: URL, or an allowed local path.

    Only the header is read here; data: URL bytes are bounded by the body limit."""
    from PIL import Image

    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        try:
            raw = data_url_bytes(url, "image")
        except EdgevlError as e:
            raise HTTPError(400, str(e), param, "invalid_image") from None
        return PendingImage(lambda: Image.open(io.BytesIO(raw)), param)
    if scheme in ("http", "https", "ftp"):
        raise HTTPError(400, "remote image URLs are not fetched; send the image inline as a data: URL "
                        "(data:image/png;base64,...)", param, "remote_image_url")
    if scheme == "file":
        try:
            path = file_url_path(url)
        except EdgevlError as e:
            raise HTTPError(400, str(e), param) from None
    elif len(scheme) > 1:
        raise HTTPError(400, f"unsupported image URL scheme {scheme!r}; use a data: URL", param, "invalid_image")
    else:
        path = url  # a plain path (a one-letter "scheme" is a Windows drive)
    root = server.image_dir
    if root is None:
        raise HTTPError(403, "local image paths are disabled on this server; send a data: URL (or start the "
                        "server with --allow-image-dir DIR)", param, "image_path_forbidden")
    try:
        full = (root / path).resolve()  # an absolute path replaces root; symlinks and .. are resolved
    except (OSError, ValueError) as e:  # a NUL byte, a symlink loop, ...
        raise HTTPError(400, f"bad image path {path!r} ({e})", param, "invalid_image") from None
    if not full.is_relative_to(root):
        raise HTTPError(403, f"image path {path!r} is outside the allowed image folder", param,
                        "image_path_forbidden")

    def opener():
        # checked again where it is opened, on the open descriptor: the file may have been swapped
        # for a symlink to somewhere else while the request waited for the model
        return Image.open(open_regular(root / path, root, path, "image"))

    return PendingImage(opener, param)


class PendingVideo:
    """A video_url's clip, checked from its header (frames, size: the tokens it will take) when the
    request arrives and decoded once the request holds the model: an allowed local file or folder
    (every file checked again where it is opened), or a data: URL's bytes in an unnamed temporary
    file, which ``close`` frees when the request ends (and which a killed server cannot leave
    behind: it never has a name)."""

    def __init__(self, source, param: str, server, options: dict):
        self.source, self.param, self.model, self.options = source, param, server.model, options
        self.max_decode = server.max_video_decode
        try:
            self.tokens = server.model.video_tokens(source, **options, max_decode=self.max_decode)
        except VideoTooCostly as e:
            self.close()
            raise HTTPError(400, str(e), param, "video_too_large") from None
        except OutsideFolder as e:
            self.close()
            raise HTTPError(403, str(e), param, "image_path_forbidden") from None
        except EdgevlError as e:
            self.close()
            raise HTTPError(400, str(e), param, "invalid_video") from None
        except BaseException:
            self.close()
            raise

    def decode(self, gone=None):
        """The clip decoded here, on the request's own thread, not the model's: a long clip (or a
        bomb of frames) must not stall the other requests' decoding. ``gone()``: the client hung
        up, which stops the decoding (a ConnectionAbortedError). A clip the encoding cache holds is
        left to the model."""
        from .processing.video import DecodeCancelled, DecodedVideo, cancel_when, load_video

        model = self.model
        digest = model.video_digest(self.source)
        if model.video_cached(digest, **self.options):
            return self.source
        try:
            with cancel_when(gone):
                sampled = load_video(self.source, model.vision.video_cfg, **self.options, max_decode=self.max_decode)
        except DecodeCancelled:
            raise ConnectionAbortedError("the client hung up while its video was decoded") from None
        except OutsideFolder as e:   # a file swapped for a way out since the request arrived
            raise HTTPError(403, str(e), self.param, "image_path_forbidden") from None
        except VideoTooCostly as e:  # ... or for a longer clip
            raise HTTPError(400, str(e), self.param, "video_too_large") from None
        except EdgevlError as e:
            raise HTTPError(400, str(e), self.param, "invalid_video") from None
        except MemoryError:
            raise HTTPError(400, "not enough memory to decode the video; send a smaller one or sample fewer "
                            "frames", self.param, "video_too_large") from None
        return DecodedVideo(sampled, digest)

    def close(self) -> None:
        if self.source.file is not None:
            self.source.file.close()


def close_videos(messages) -> None:
    """Free the temporary files of a request's videos (once it is answered, refused or abandoned)."""
    for m in messages or ():
        for p in m["content"] if isinstance(m, dict) and isinstance(m.get("content"), list) else ():
            if isinstance(p, dict) and isinstance(p.get("video"), PendingVideo):
                p["video"].close()


def _video(url: str, server, param: str, options: dict) -> PendingVideo:
    """A pending video from a video_url: a base64 data: URL (data:video/mp4;base64,...), or an
    allowed local path under the rules of image paths (a file: URL naming no host)."""
    import tempfile

    from .processing.video import VideoFile

    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        try:
            raw = data_url_bytes(url, "video")
        except EdgevlError as e:
            raise HTTPError(400, str(e), param, "invalid_video") from None
        # unnamed (O_TMPFILE where the system has it, else unlinked at once): nothing to clean up
        f = tempfile.TemporaryFile(prefix="edgevl-video-")
        try:
            f.write(raw)
            f.flush()
        except OSError as e:
            f.close()
            raise HTTPError(503, f"the server cannot store the video ({e.strerror}); try again later", param,
                            "server_busy") from None
        return PendingVideo(VideoFile(file=f, name="the video"), param, server, options)
    if scheme in ("http", "https", "ftp"):
        raise HTTPError(400, "remote video URLs are not fetched; send the video inline as a data: URL "
                        "(data:video/mp4;base64,...)", param, "remote_image_url")
    if scheme == "file":
        try:
            path = file_url_path(url)
        except EdgevlError as e:
            raise HTTPError(400, str(e), param, "invalid_video") from None
    elif len(scheme) > 1:
        raise HTTPError(400, f"unsupported video URL scheme {scheme!r}; use a data: URL", param, "invalid_video")
    else:
        path = url  # a plain path (a one-letter "scheme" is a Windows drive)
    root = server.image_dir
    if root is None:
        raise HTTPError(403, "send the video as a data: URL (local paths need the server started with "
                        "--allow-image-dir DIR)", param, "image_path_forbidden")
    try:
        full = (root / path).resolve()
    except (OSError, ValueError) as e:
        raise HTTPError(400, f"bad video path {path!r} ({getattr(e, 'strerror', None) or 'not a valid path'}); "
                        "check it", param, "invalid_video") from None
    if not full.is_relative_to(root):
        raise HTTPError(403, f"video path {path!r} is outside the allowed folder", param, "image_path_forbidden")
    if full == root:    # "", ".", "file://": every image in the folder would be one clip
        raise HTTPError(400, f"{param}.video_url.url names no video (it is the allowed folder itself); give a "
                        "video file or a folder of frames inside it", param, "invalid_video")
    return PendingVideo(VideoFile(full, root=root, name=path), param, server, options)


def _check_text(obj, where: str = "") -> None:
    """Every string in the request must be valid Unicode: JSON allows lone surrogates
    ("\\ud800"), which no tokenizer can take."""
    stack = [(obj, where)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise HTTPError(400, f"{at or 'the request'} contains invalid Unicode (a lone surrogate such as "
                                "\\ud800); send valid UTF-8 text", at or None, "invalid_text") from None
        elif isinstance(v, dict):
            for k, x in v.items():
                stack.append((k, at or "the request"))
                stack.append((x, f"{at}.{k}" if at else str(k)))
        elif isinstance(v, list):
            stack.extend((x, f"{at}[{i}]") for i, x in enumerate(v))


def _messages(raw, server, video_options: dict | None = None) -> list[dict]:
    """OpenAI messages -> edgevl messages (image_url parts become PendingImages, checked from their
    headers: size, pixel budget, patch budget and context; decoded later by ``decode_images``;
    video_url parts PendingVideos, sampled by ``video_options``). Refused, it frees the
    temporary files of the videos it took."""
    out = []
    try:
        return _parts(raw, server, video_options or {}, out)
    except BaseException:
        close_videos(out)
        raise


def _parts(raw, server, video_options: dict, out: list) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise HTTPError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    budget, image_tokens = MAX_IMAGE_PIXELS, 0
    vision = server.model.vision
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise HTTPError(400, f"{where} must be an object with role and content", where)
        role = "system" if m.get("role") == "developer" else m.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise HTTPError(400, f"{where}.role must be system (or developer), user, assistant or tool, got "
                            f"{m.get('role')!r}", f"{where}.role")
        content = m.get("content")
        if content is None and role == "assistant":  # e.g. an earlier tool-call turn
            content = ""
        if (role == "tool" or (role == "assistant" and m.get("tool_calls"))) and not tool_calls.call_format(
                server.model):   # its template would render them as something else, or not at all
            raise HTTPError(400, f"{where}.role {role} with tool calls or results needs a model whose chat template "
                            f"has a tool-call format; this model ({server.model.arch.name}) has none", f"{where}.role")
        extra = _tool_fields(m, role, where)
        if isinstance(content, str):
            out.append({"role": role, "content": content, **extra})
            continue
        if not isinstance(content, list):
            raise HTTPError(400, f"{where}.content must be a string or a list of parts", f"{where}.content")
        parts = []
        out.append({"role": role, "content": parts, **extra})   # filled in place: a refusal can free its videos
        for j, p in enumerate(content):
            param = f"{where}.content[{j}]"
            kind = p.get("type") if isinstance(p, dict) else None
            if kind == "text" and isinstance(p.get("text"), str):
                parts.append({"type": "text", "text": p["text"]})
            elif kind == "refusal" and role == "assistant" and isinstance(p.get("refusal"), str):
                parts.append({"type": "text", "text": p["refusal"]})   # an earlier answer's, as OpenAI sends it
            elif kind == "image_url":
                url = p.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str) or not url.strip():
                    raise HTTPError(400, f"{param}.image_url.url must be a data: URL (or a path where the server "
                                    "allows them)", param)
                if vision is None:
                    raise HTTPError(400, "this model has no vision tower; it cannot take images", param)
                im = _image(url, server, param)
                budget -= im.width * im.height
                if budget < 0:
                    raise _too_many_pixels(param)
                try:  # an image the patch budget or the context cannot hold is refused before decoding
                    image_tokens += vision.image_tokens(im.height, im.width, server.max_image_patches)
                except EdgevlError as e:
                    raise HTTPError(400, str(e), param, "invalid_image") from None
                if image_tokens >= server.model.max_context:
                    raise HTTPError(400, f"the request's images need {image_tokens} tokens, but this model's maximum "
                                    f"context length is {server.model.max_context} tokens; send fewer or smaller "
                                    "images", param, "context_length_exceeded")
                parts.append({"type": "image", "image": im})
            elif kind == "video_url":
                url = p.get("video_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise HTTPError(400, f"{param}.video_url.url must be a string", param)
                if not server.model.takes_video:
                    raise HTTPError(400, "this model has no vision tower; it takes no video" if server.model.vision
                                    is None else f"this model ({server.model.arch.name}) takes no video", param,
                                    "invalid_video")
                v = _video(url, server, param, video_options)
                parts.append({"type": "video", "video": v})
                image_tokens += v.tokens
                if image_tokens >= server.model.max_context:
                    raise HTTPError(400, f"the request's images and videos need {image_tokens} tokens, but this "
                                    f"model's maximum context length is {server.model.max_context} tokens; send a "
                                    "shorter video or "
                                    "sample fewer or smaller frames (video_options fps, max_frames, max_pixels)",
                                    param, "context_length_exceeded")
            elif kind == "text":
                raise HTTPError(400, f"{param}.text must be a string", param)
            else:
                raise HTTPError(400, f"{param} must be a text, image_url or video_url part", param)
    try:
        out[:] = tool_calls.pair_results(out)
    except EdgevlError as e:
        raise HTTPError(400, str(e), getattr(e, "param", "messages")) from None
    return out


def _tool_fields(m: dict, role: str, where: str) -> dict:
    """An assistant turn's ``tool_calls`` and a tool result's ``tool_call_id``, checked, for the
    chat template to render back."""
    if role == "tool":
        cid = m.get("tool_call_id")
        if cid is not None and not isinstance(cid, str):
            raise HTTPError(400, f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
        return {"tool_call_id": cid} if cid else {}
    if role != "assistant":
        return {}
    # the turn's thinking, as the openai SDK replays it: templates that think keep the thinking of
    # the turns after the last user message (a tool loop's), and the prompt then matches the tokens
    # the answer was (prefix reuse)
    thought = m.get("reasoning_content")
    if thought is not None and not isinstance(thought, str):
        raise HTTPError(400, f"{where}.reasoning_content must be a string", f"{where}.reasoning_content")
    extra = {"reasoning_content": thought} if thought else {}
    calls = m.get("tool_calls")
    if not calls:
        return extra
    if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
            and isinstance(c["function"].get("arguments", "{}"), str) for c in calls):
        raise HTTPError(400, f"{where}.tool_calls must be a list of {{\"id\", \"type\": \"function\", \"function\": "
                        "{\"name\", \"arguments\"}} objects, arguments a JSON string", f"{where}.tool_calls")
    try:
        return {**extra, "tool_calls": tool_calls.template_messages([{"tool_calls": calls}])[0]["tool_calls"]}
    except EdgevlError as e:
        raise HTTPError(400, str(e), f"{where}.tool_calls") from None


def _tools(req: dict, server: EdgevlServer):
    """The request's tools checked (``tools.ToolSpec``), or None; 400 when bad."""
    if req.get("functions") or req.get("function_call"):
        raise HTTPError(400, "functions / function_call (OpenAI's deprecated form) are not supported; send tools and "
                        "tool_choice", "functions")
    try:
        return tool_calls.prepare(server.model, req.get("tools"), req.get("tool_choice"),
                                  req.get("parallel_tool_calls"))
    except EdgevlError as e:
        param = "tool_choice" if str(e).startswith("tool_choice") else "parallel_tool_calls" if str(e).startswith(
            "parallel") else "tools"
        raise HTTPError(400, str(e), param, "invalid_tools") from None


def _unit(req: dict, key: str) -> float | None:
    v = _number(req, key, None)
    if v is not None and not 0 <= v <= 1:
        raise HTTPError(400, f"{key} must be from 0 to 1, got {v}", key)
    return v


def _penalty(req: dict, key: str) -> float:
    v = _number(req, key, None)
    if v is None:
        return 0.0
    if not -2 <= v <= 2:
        raise HTTPError(400, f"{key} must be from -2 to 2, got {v}", key)
    return v


def _common(req: dict, server: EdgevlServer, default_max_tokens: int | None) -> tuple[dict, bool, bool]:
    """What both endpoints take (the model's name, n, stream, the token budget, stop strings,
    sampling settings): (stream_choices kwargs, stream, include_usage) or HTTPError."""
    _check_text(req)
    model = req.get("model")
    if model is not None and not isinstance(model, str):
        raise HTTPError(400, f"model must be a string, got {type(model).__name__}", "model")
    if model is not None and server.strict_model and model not in server.model_ids:
        raise HTTPError(404, f"the model {model!r} does not exist; this server runs {server.model_id!r}",
                        "model", "model_not_found")
    n = req.get("n")
    n = 1 if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise HTTPError(400, f"n must be an integer from 1 to {MAX_CHOICES}, got {n!r:.40}", "n")
    try:
        bias = check_logit_bias(req.get("logit_bias"), server.model.vocab_size)
    except EdgevlError as e:
        raise HTTPError(400, str(e), "logit_bias") from None
    stream = req.get("stream") or False
    opts = req.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(opts, dict):
        raise HTTPError(400, "stream must be true or false and stream_options an object", "stream")
    if opts.get("include_usage") is not None and not isinstance(opts["include_usage"], bool):
        raise HTTPError(400, "stream_options.include_usage must be true or false", "stream_options")
    named = "max_completion_tokens" if req.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(req, named, None, int)
    if max_tokens is not None and max_tokens < 1:
        raise HTTPError(400, f"{named} must be >= 1, got {max_tokens}", named)
    try:
        stop = stop_strings(req.get("stop"))
    except EdgevlError as e:
        raise HTTPError(400, str(e), "stop") from None
    seed = _number(req, "seed", None, int)
    if seed is not None and seed < 0:
        raise HTTPError(400, f"seed must be >= 0, got {seed}", "seed")
    if max_tokens is None:
        max_tokens = default_max_tokens
    if server.max_tokens is not None:   # the operator's cap (--max-tokens): a longer answer ends as "length"
        max_tokens = server.max_tokens if max_tokens is None else min(max_tokens, server.max_tokens)
    kwargs = dict(
        max_new_tokens=server.model.max_context if max_tokens is None else max_tokens,  # the context end stops it
        temperature=_setting(req, "temperature"), top_p=_setting(req, "top_p"),  # None: the model's
        top_k=_setting(req, "top_k", int), repetition_penalty=_setting(req, "repetition_penalty"),
        min_p=_unit(req, "min_p"),
        presence_penalty=_penalty(req, "presence_penalty"), frequency_penalty=_penalty(req, "frequency_penalty"),
        seed=seed, stop=stop, logit_bias=bias, n=n)
    return kwargs, stream, bool(opts.get("include_usage"))


def parse_request(req: dict, server: EdgevlServer) -> tuple[list, dict, bool, bool]:
    """(messages, stream_choices kwargs, stream, include_usage) or HTTPError."""
    kwargs, stream, include_usage = _common(req, server, None)
    logprobs, top = req.get("logprobs"), req.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise HTTPError(400, "logprobs must be true or false", "logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise HTTPError(400, f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}", "top_logprobs")
    if top and not logprobs:
        raise HTTPError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    spec = _tools(req, server)   # a model without a call format refuses them: ignoring them would look like
    # a model that never calls
    ctk = _template_kwargs(req, server)
    if spec is not None and spec.render:   # the prompt's length counts the tools the template renders
        ctk = {**ctk, "tools": spec.render}
    kwargs.update(allow_special_in_content=server.allow_special_in_content,
                  max_image_patches=server.max_image_patches, chat_template_kwargs=ctk, logprobs=bool(logprobs),
                  top_logprobs=top or 0)
    kwargs["response_format"] = _structure(req, server)
    if spec is not None and spec.parses and spec.structure is None and kwargs["response_format"] is not None:
        try:   # "auto" with a format: checked now, before the request queues
            kwargs["response_format"] = structured.compiled(
                server.model, tool_calls.with_calls(server.model, kwargs["response_format"].structure, spec))
        except EdgevlError as e:
            raise HTTPError(400, str(e), "tools", "invalid_request_error") from None
    kwargs["tools"] = spec
    from .processing.video import check_options as check_video_options

    # edgevl's extension, as the API's: {"fps": 1, "max_frames": 32, "max_pixels": 2000000}
    try:
        kwargs["video_options"] = check_video_options(req.get("video_options"))
    except EdgevlError as e:
        raise HTTPError(400, str(e), "video_options") from None
    messages = _messages(req.get("messages"), server, kwargs["video_options"])
    try:
        _check_length(messages, ctk, server)
    except BaseException:
        close_videos(messages)
        raise
    return messages, kwargs, stream, include_usage


def _template_kwargs(req: dict, server: EdgevlServer) -> dict:
    """vLLM's extension ``chat_template_kwargs`` (values for the chat template, e.g.
    {"enable_thinking": false}) over the server's defaults, checked."""
    ctk = req.get("chat_template_kwargs")
    if ctk is not None and not isinstance(ctk, dict):
        raise HTTPError(400, "chat_template_kwargs must be an object", "chat_template_kwargs")
    if ctk and (ctk.get("tools") or ctk.get("functions")):  # the template would render them into the prompt
        raise HTTPError(400, NO_TOOLS, "chat_template_kwargs.tools")
    effort, thinking = req.get("reasoning_effort"), server.thinking
    if effort is not None:
        if effort not in responses.EFFORTS:
            raise HTTPError(400, f"reasoning_effort must be one of {', '.join(responses.EFFORTS)}, got {effort!r:.40}",
                            "reasoning_effort")
        # a model's thinking is on or off: "none" switches it off, any effort on (where the model
        # can switch it; chat_template_kwargs still decide over both)
        thinking = effort != "none"
    try:
        return model_template_kwargs(server.model, {**server.chat_template_kwargs, **(ctk or {})}, thinking)
    except EdgevlError as e:
        raise HTTPError(400, str(e), "chat_template_kwargs") from None


# OpenAI's default budget of a (legacy) text completion
COMPLETION_MAX_TOKENS = 16


def parse_completion(req: dict, server: EdgevlServer) -> tuple[str, dict, bool, bool, bool]:
    """POST /v1/completions (OpenAI's legacy text completion: the prompt as it is, no chat
    template): (prompt, stream_choices kwargs, stream, include_usage, echo) or HTTPError."""
    kwargs, stream, include_usage = _common(req, server, COMPLETION_MAX_TOKENS)
    prompt = req.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        raise HTTPError(400, "one prompt per request; send the others as requests of their own (they decode "
                        "together)", "prompt")
    if not isinstance(prompt, str):
        raise HTTPError(400, "prompt must be a string (token id prompts are not supported)", "prompt")
    if not prompt.strip():
        raise HTTPError(400, "the prompt is empty; send some text", "prompt")
    if req.get("suffix"):
        raise HTTPError(400, "suffix (fill in the middle) is not supported", "suffix")
    if req.get("best_of", 1) not in (1, None):
        raise HTTPError(400, "only best_of=1 is supported", "best_of")
    if req.get("tools") or req.get("tool_choice"):   # ignored, the model would look like one that never calls
        raise HTTPError(400, "tools need a chat template: send them to /v1/chat/completions", "tools")
    echo, lp = (False if req.get("echo") is None else req["echo"]), req.get("logprobs")
    if not isinstance(echo, bool):
        raise HTTPError(400, "echo must be true or false", "echo")
    if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_TOP_LOGPROBS):
        raise HTTPError(400, f"logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS} (the alternatives to list)",
                        "logprobs")
    if echo and lp is not None:
        raise HTTPError(400, "echo with logprobs would need the prompt's log-probabilities, which are not "
                        "given; drop echo or logprobs", "echo")
    # the continuation as written: no template, no reasoning taken apart, no coordinates rewritten
    kwargs.update(raw=True, postprocess=False, split_reasoning=False, logprobs=lp is not None, top_logprobs=lp or 0)
    kwargs["response_format"] = _structure(req, server)
    _check_prompt_tokens(prompt, server, 0, "prompt", "")
    return prompt, kwargs, stream, include_usage, echo


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _structure(req: dict, server: EdgevlServer):
    """The answer's structure, compiled for the model (``structured.Compiled``), or None: from
    ``response_format``, or vLLM's ``structured_outputs`` / ``guided_*`` extension; 400 when bad."""
    given = [k for k in ("response_format", "structured_outputs", *GUIDED) if req.get(k) is not None]
    rf = req.get("response_format")
    if isinstance(rf, dict) and rf.get("type") == "text" and len(given) > 1:
        given.remove("response_format")
        rf = None
    if len(given) > 1:
        raise HTTPError(400, f"give one of {', '.join(given)}, not several", given[1], "invalid_response_format")
    if not given:
        return None
    param = given[0]
    try:
        if param == "structured_outputs":
            so = req[param]
            if not isinstance(so, dict) or len([k for k in so if so[k] is not None]) != 1:
                raise EdgevlError("structured_outputs must be an object with one of json, json_object, regex, "
                                  "choice, grammar")
            (key, value), = ((k, v) for k, v in so.items() if v is not None)
            structure = _extension(key, value, f"{param}.{key}")
        elif param in GUIDED:
            structure = _extension(GUIDED[param], req[param], param)
        else:
            structure = structured.parse(rf)
        return None if structure is None else structured.compiled(server.model, structure, param)
    except EdgevlError as e:
        raise HTTPError(400, str(e), param, "invalid_response_format") from None


def _extension(key: str, value, where: str):
    """The structure of vLLM's extension field ``key``, its errors named as the request names it."""
    if key == "json":
        return structured.json_schema(value, where=where)
    if key == "json_object":
        return structured.parse({"type": "json_object"})
    if key in ("regex", "choice", "grammar"):
        return getattr(structured, key)(value, where)
    raise EdgevlError(f"{where} is not a structure; use json, json_object, regex, choice or grammar")


def token_span(tok) -> int:
    """The most characters one token stands for: the longest vocabulary entry (a byte-level
    vocabulary spells each byte as one character, so this bounds the bytes too)."""
    return max([len(t) for t in tok.tok.get_vocab(with_added_tokens=True)] or [1])


def count_tokens(tok, text: str, limit: int, span: int | None = None) -> tuple[int, bool]:
    """(a lower bound of the number of tokens of ``text``, whether it is the exact number).

    Counted piece by piece, stopping once the bound reaches ``limit``: the tokenizer's memory is
    that of one piece however long the text, and a batch encode releases the GIL, so /health and
    a running generation go on meanwhile (a plain encode holds it throughout). The whole text may
    tokenize differently where a piece was cut (a token of up to ``span`` characters across the
    cut, split in two), so the tokens within ``span`` characters of a cut are not counted."""
    span = span or token_span(tok)
    n = i = pieces = 0
    while i < len(text):
        j = min(i + PIECE, len(text))
        if j < len(text):
            # before a space or a newline if the piece's second half has one: a word keeps its
            # leading space, and most such cuts split no token
            ws = max(text.rfind(" ", i + PIECE // 2, j), text.rfind("\n", i + PIECE // 2, j))
            j = ws if ws > i else j
        offsets = tok.tok.encode_batch([text[i:j]], add_special_tokens=False)[0].offsets
        n += len(offsets)
        if i > 0:
            n -= sum(1 for a, _ in offsets if a < span)
        if j < len(text):
            n -= sum(1 for _, b in offsets if b > j - i - span)
        i, pieces = j, pieces + 1
        if n >= limit:
            break
    return max(0, n), pieces == 1 and i == len(text)


def _check_length(messages: list, ctk: dict, server: EdgevlServer) -> None:
    """Refuse, before the request queues, a prompt the context cannot hold. Its rendered text is
    judged by its length alone when no tokenization could bring it under the context, else by
    ``count_tokens``. (An 8 MB message was tokenized whole with the model held: 2 GB and seconds
    of a tokenizer holding the GIL, /health waiting, only for the prefill to refuse it.)"""
    model = server.model
    images = [p["image"] for m in messages if isinstance(m["content"], list) for p in m["content"]
              if p["type"] == "image"]
    image_tokens = sum(model.vision.image_tokens(im.height, im.width, server.max_image_patches) for im in images)
    videos = [p["video"] for m in messages if isinstance(m["content"], list) for p in m["content"]
              if p["type"] == "video"]
    image_tokens += sum(v.tokens for v in videos)
    images += videos
    try:
        text = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **ctk)
    except EdgevlError as e:
        if not any(m["role"] == "user" for m in messages):   # what templates refuse most, after a late system turn
            raise HTTPError(400, f"{e} (the messages have no user message, which this model's chat template "
                            "needs; send the request as a user message)", "messages", "invalid_request") from None
        # a system message after the conversation began is what templates refuse most: name it
        late = next((i for i, m in enumerate(messages) if m["role"] == "system"
                     and any(x["role"] != "system" for x in messages[:i])), None)
        raise HTTPError(400, str(e) + ("" if late is None else f" (messages[{late}] is a system message after the "
                                       "conversation began; fold it into the first, or send it as a user message)"),
                        None if late is None else f"messages[{late}]", "invalid_request") from None
    # the text has one placeholder token per image and a start/pad/end group per video (where the
    # template wraps the pad), which become their tokens
    held = len(images) - len(videos)
    if videos:
        from .generate import video_placeholder_tokens

        held += video_placeholder_tokens(model.tokenizer, model, text)
    _check_prompt_tokens(text, server, image_tokens - held, "messages",
                         (" or send a shorter video" if videos else "")
                         + (" or send fewer or smaller images" if len(images) > len(videos) else ""))


def _check_prompt_tokens(text: str, server: EdgevlServer, extra: int, param: str, more: str) -> None:
    """Refuse ``text`` whose tokens (with ``extra`` more) would fill the context, counted no
    further than the context (``count_tokens``)."""
    model = server.model
    room = model.max_context - extra
    span = server.token_span
    if len(text) >= room * span * 4:  # 4: normalizers may merge characters (a letter and its accents) first
        n, exact = len(text) // (span * 4), False
    else:
        n, exact = count_tokens(model.tokenizer, text, room, span)
    if n >= room:
        # worded as OpenAI's and vLLM's, which clients (litellm) recognize as a context overflow
        raise HTTPError(400, f"the prompt has {'' if exact else 'at least '}{n + extra} tokens, but this model's "
                        f"maximum context length is {model.max_context} tokens; shorten the prompt{more}",
                        param, "context_length_exceeded")


def decode_images(messages: list, gone=None) -> list:
    """The messages with every pending image and video decoded (call with a slot held);
    ``gone()``: the client hung up, which stops a video's decoding."""
    out = []
    for m in messages:
        if isinstance(m["content"], list):
            m = dict(m, content=[dict(p, image=p["image"].decode()) if p["type"] == "image" else
                                 dict(p, video=p["video"].decode(gone)) if p["type"] == "video" else p
                                 for p in m["content"]])
        out.append(m)
    return out


def tokenize_request(req: dict, server: EdgevlServer) -> list[int]:
    """The token ids of POST /tokenize: llama-server's ``content`` or vLLM's ``prompt`` (text as
    written, as /v1/completions reads it) or ``messages`` (text messages, rendered and tokenized as
    the chat endpoint does); refused past the context, as a request would be."""
    _check_text(req)
    given = [k for k in ("content", "prompt", "messages") if req.get(k) is not None]
    if len(given) != 1:
        raise HTTPError(400, "send one of content or prompt (text as written) or messages (rendered by the chat "
                        "template)", given[1] if given else "content")
    key, model = given[0], server.model
    if key != "messages":
        if not isinstance(req[key], str):
            raise HTTPError(400, f"{key} must be a string", key)
        _check_prompt_tokens(req[key], server, 0, key, "")
        return model.tokenizer.encode(req[key])
    raw = req["messages"]
    if isinstance(raw, list) and any(isinstance(m, dict) and isinstance(m.get("content"), list) and any(
            not isinstance(p, dict) or p.get("type") != "text" for p in m["content"]) for m in raw):
        raise HTTPError(400, "/tokenize takes text messages; images and videos count as the chat endpoint "
                        "reports in usage.prompt_tokens", "messages")
    messages = _messages(raw, server)
    ctk = _template_kwargs(req, server)
    spec = _tools(req, server)      # rendered as the chat endpoint renders them: the same count
    if spec is not None and spec.render:
        ctk = {**ctk, "tools": spec.render}
    _check_length(messages, ctk, server)
    try:
        return encode_messages(model.tokenizer, tool_calls.template_messages(messages),
                               server.allow_special_in_content, ctk)
    except EdgevlError as e:
        raise HTTPError(400, str(e), "messages") from None


class TextOffsets:
    """Where each token of an answer starts in its text, in characters (the legacy logprobs'
    ``text_offset``), counted alike streamed or not: a token holding part of a character shows it
    as U+FFFD but adds to the text only once the character is whole."""

    def __init__(self, start: int, skipped=frozenset()):
        import codecs

        self.at = start
        self.chars = codecs.getincrementaldecoder("utf-8")("replace")
        self.skipped = skipped      # special tokens the answer's text leaves out

    def take(self, entry: dict) -> int:
        at = self.at
        if entry["token"] in self.skipped:
            return at
        raw = entry.get("bytes")
        self.at += len(self.chars.decode(bytes(raw))) if raw is not None else len(entry["token"])
        return at


def _legacy_logprobs(entries: list, offsets: TextOffsets) -> dict:
    """``Event.logprobs`` entries in the legacy completion's shape (each token's alternatives as
    {token: logprob}, the token taken among them; ``text_offset``: where each token starts)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        out["tokens"].append(e["token"])
        out["token_logprobs"].append(e["logprob"])
        out["top_logprobs"].append({**{t["token"]: t["logprob"] for t in e["top_logprobs"]}, e["token"]: e["logprob"]})
        out["text_offset"].append(offsets.take(e))
    return out


def _usage(lasts: list) -> dict:
    """From each answer's last event: the prompt counted once, the answers' tokens together."""
    ev, made = lasts[0], sum(e.generation_tokens for e in lasts)
    return {"prompt_tokens": ev.prompt_tokens, "completion_tokens": made, "total_tokens": ev.prompt_tokens + made,
            "prompt_tokens_details": {"cached_tokens": ev.prompt_tokens - ev.prefill_tokens},
            "completion_tokens_details": {"reasoning_tokens": sum(e.reasoning_tokens for e in lasts)}}


# -- metrics (GET /metrics) -----------------------------------------------------------------------

# path -> (method, Handler method); besides them /v1/models/{id} and the page's /web/{file}
ROUTES = {"/health": ("GET", "_health"), "/v1/models": ("GET", "_models"), "/v1/chat/completions": ("POST", "_chat"),
          "/props": ("GET", "_props"), "/v1/completions": ("POST", "_completions"),
          "/v1/responses": ("POST", "_responses"), "/tokenize": ("POST", "_tokenize"),
          "/detokenize": ("POST", "_detokenize"), "/metrics": ("GET", "_metrics"), "/": ("GET", "_index")}
GENERATING = ("/v1/chat/completions", "/v1/responses", "/v1/completions")   # refused while draining
REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")     # a client's X-Request-Id we echo: visible ASCII
# seconds; a CPU's first token takes from a fraction of a second (short text) to minutes (video)
TTFT_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
TPOT_BUCKETS = (0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1)
DURATION_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)


def _route_label(path: str) -> str:
    """A request's route as a label: the known routes, and one value for all others (a label
    per unknown path would let clients grow the metrics without bound)."""
    path = urlsplit(path).path.rstrip("/") or "/"
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}"
    if path.startswith("/web/"):
        return "/web"
    return path if path in ROUTES else "other"


def server_metrics(server) -> Registry:
    """The metrics of ``server`` (docs/openai-api.md, "Metrics"): its own counts and latencies,
    the gate's and the engine's counters read when scraped, the process's memory and CPU time."""
    reg, engine, gate, model = Registry(), server.engine, server.gate, server.model
    reg.add("edgevl_info", "The model served and this edgevl (always 1).", "gauge",
            ("model", "family", "dtype", "version"),
            read=lambda: {(server.model_id, model.arch.name, model.dtype, __version__): 1})
    reg.add("edgevl_slots", "Requests that can decode at once (--parallel).", "gauge", read=lambda: engine.parallel)
    reg.add("edgevl_requests_running", "Requests holding a slot.", "gauge", read=lambda: gate.held)
    reg.add("edgevl_requests_waiting", "Requests waiting for a slot (429 past --max-queue).", "gauge",
            read=lambda: gate.waiting)
    reg.add("edgevl_http_requests_total", "HTTP requests answered, by route and status code.",
            labels=("route", "status"))
    reg.add("edgevl_answers_total", "Answers generated (n per request) by how they ended: stop, length, cancelled "
            "(the client went away), refused (the request's mistake, found once it ran: a 400) or error (the "
            "server's fault: a 500).", labels=("finish_reason",))
    reg.add("edgevl_prompt_tokens_total", "Prompt tokens of the requests that ran (usage.prompt_tokens).")
    reg.add("edgevl_prompt_tokens_cached_total", "Prompt tokens taken from a slot's cache instead of computed "
            "(usage.prompt_tokens_details.cached_tokens).")
    reg.add("edgevl_generation_tokens_total", "Tokens generated (usage.completion_tokens).")
    reg.add("edgevl_draft_tokens_total", "Tokens drafted by speculative decoding.")
    reg.add("edgevl_draft_tokens_accepted_total", "Drafted tokens that the model's own pass confirmed.")
    reg.add("edgevl_time_to_first_token_seconds", "From a request's arrival to its first token, waiting for a "
            "slot included.", "histogram", buckets=TTFT_BUCKETS)
    reg.add("edgevl_time_per_output_token_seconds", "A request's time per token after its first (of its first "
            "answer).", "histogram", buckets=TPOT_BUCKETS)
    reg.add("edgevl_request_duration_seconds", "From a request's arrival to its (first) answer's end.", "histogram",
            buckets=DURATION_BUCKETS)
    reg.add("edgevl_engine_forwards_total", "Decoder forwards of the engine: decode (a row, or a verify pass, of "
            "each decoding request) and prompt (prompt chunks beside the decoding requests' rows).",
            labels=("kind",), read=lambda: {("decode",): engine.steps, ("prompt",): engine.prompts})
    reg.add("edgevl_engine_decode_rows_total", "Rows the decode forwards carried (over the decode forwards: the "
            "mean batch).", read=lambda: engine.rows)
    reg.add("edgevl_image_cache_requests_total", "Images and video files the vision tower was asked to encode, by "
            "whether the image cache held them (hit: not encoded again).", labels=("result",),
            read=lambda: {("hit",): model.image_cache.hits, ("miss",): model.image_cache.misses})
    reg.add("edgevl_image_cache_bytes", "Bytes of encoded images the image cache holds (--image-cache-mb).",
            "gauge", read=lambda: model.image_cache.bytes)
    process_metrics(reg)
    return reg


class _Observed:
    """One answer's events on their way to the client, counted in the server's metrics (and
    handed to ``on_end(index, last event)``) once the answer ends (its last event), is closed
    before its end (the client went away, or another answer failed) or fails."""

    def __init__(self, choice, index: int, arrived: float, metrics: Registry, on_end=None):
        self.choice, self.index, self.arrived, self.metrics, self.on_end = choice, index, arrived, metrics, on_end
        self.first = self.last = None
        self.done = False

    def __iter__(self):
        return self

    def __next__(self):
        try:
            ev = next(self.choice)
        except StopIteration:
            self._end(self.last.finish_reason if self.last is not None else "stop")
            raise
        except BaseException as e:
            # the request's own mistake, found only once it ran (a 400), or the server's fault
            self._end("refused" if isinstance(e, EdgevlError) and not isinstance(e, (PackageError, ShuttingDown))
                      else "error")
            raise
        if self.first is None:
            self.first = time.monotonic()
        self.last = ev
        return ev

    def close(self) -> None:
        self._end("cancelled")
        self.choice.close()

    def _end(self, reason) -> None:
        if self.done:
            return
        self.done = True
        m, now, ev = self.metrics, time.monotonic(), self.last
        m.inc("edgevl_answers_total", finish_reason=reason or "stop")
        if ev is None:
            return
        if self.on_end is not None:
            self.on_end(self.index, ev)
        m.inc("edgevl_generation_tokens_total", ev.generation_tokens)
        m.inc("edgevl_draft_tokens_total", ev.drafted)
        m.inc("edgevl_draft_tokens_accepted_total", ev.accepted)
        if self.index != 0:
            return
        # once per request, whatever n: its prompt, and its latencies as its first answer's (the
        # others of an answer not streamed are read only after it, so their times say nothing)
        m.inc("edgevl_prompt_tokens_total", ev.prompt_tokens)
        m.inc("edgevl_prompt_tokens_cached_total", ev.prompt_tokens - ev.prefill_tokens)
        m.observe("edgevl_time_to_first_token_seconds", self.first - self.arrived)
        m.observe("edgevl_request_duration_seconds", now - self.arrived)
        if ev.generation_tokens > 1:
            m.observe("edgevl_time_per_output_token_seconds", (now - self.first) / (ev.generation_tokens - 1))


# -- HTTP ----------------------------------------------------------------------------------------

class _Sink:
    """Where a HEAD request's body goes."""

    closed = False

    def write(self, data) -> int:
        return len(data)

    def flush(self) -> None:
        pass


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive; streams use chunked encoding
    # a malformed request line is answered with a status line too (HTTP/0.9 answers have none)
    default_request_version = "HTTP/1.0"
    server_version = f"edgevl/{__version__}"
    timeout = IDLE_TIMEOUT
    server: EdgevlServer

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def do_DELETE(self):
        self._dispatch("DELETE")

    def do_PATCH(self):
        self._dispatch("PATCH")

    def do_OPTIONS(self):
        self._dispatch("OPTIONS")

    def do_HEAD(self):
        """GET's status and headers without its body (load balancers' and uptime checkers' probes)."""
        real = self.wfile
        self._head_only = True
        try:
            self._dispatch("GET")
        finally:
            self._head_only = False
            self.wfile = real

    def end_headers(self):
        super().end_headers()
        if getattr(self, "_head_only", False):   # a HEAD request: what follows the headers is dropped
            self.wfile = _Sink()

    def send_error(self, code, message=None, explain=None):
        """What http.server itself refuses before a route runs (a malformed request line, too many or
        too long headers, a URL too long, an unknown method): OpenAI's JSON error, not an HTML page."""
        short = self.responses.get(code, ("error",))[0]
        body = json.dumps(HTTPError(code, f"{message or short}; fix the request").body()).encode()
        self.close_connection = True
        self.send_response(code, message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD" and code >= 200 and code not in (204, 304):
            self.wfile.write(body)

    def log_message(self, format, *args):
        if self.server.access_log:
            super().log_message(format, *args)

    def parse_request(self):
        self._request_id = None   # not the previous request's on this connection (a malformed one gets none)
        return super().parse_request()

    def log_request(self, code="-", size="-"):
        pass    # a request is logged once it is over (_dispatch): with its time and tokens

    def _log_done(self, method: str):
        """The access log's line for a request: what was asked, the status, how long it took
        and, for an answer, its tokens (as its usage counts them)."""
        path = "".join(c if c.isprintable() else repr(c)[1:-1] for c in self.path[:200])  # no terminal escapes
        line = f'"{method} {path}" {self._status} in {time.monotonic() - self._arrived:.3f} s'
        if self._tokens is not None:
            prompt, cached, made = self._tokens
            line += f", {prompt} prompt tokens ({cached} cached), {made} generated"
        self.log_message("%s [%s]", line, self._request_id)

    def _route(self, method: str):
        path = urlsplit(self.path).path.rstrip("/") or "/"
        routes = {p: (m, getattr(self, name)) for p, (m, name) in ROUTES.items()}
        if path.startswith("/v1/models/"):
            routes[path] = ("GET", lambda: self._models(path[len("/v1/models/"):]))
        if path.startswith("/web/"):
            routes[path] = ("GET", lambda: self._page(path[len("/web/"):]))
        if path not in routes:
            raise HTTPError(404, f"no route {path}; this server has POST /v1/chat/completions, POST /v1/responses, "
                            "POST /v1/completions, POST /tokenize, POST /detokenize, GET /v1/models[/ID], GET /health, "
                            "GET /metrics, GET /props and the chat page at /", code="unknown_route")
        allowed, fn = routes[path]
        if method != allowed:
            raise HTTPError(405, f"{path} takes {allowed}, not {method}", code="method_not_allowed",
                            headers={"Allow": allowed})
        if self.server.draining and path in GENERATING:
            self.close_connection = True
            raise HTTPError(503, "the server is shutting down; send the request to another instance or retry "
                            "shortly", code="shutting_down", headers={"Retry-After": "5", "Connection": "close"})
        return fn

    def _dispatch(self, method: str):
        self._sent = False  # headers out: errors can no longer get a status
        self._chunked = False  # a stream's headers are out: what is written goes in events
        self._framed = True    # ... each in a chunk (HTTP/1.1); HTTP/1.0 has no chunks: raw, then close
        self._probed = -math.inf  # when _probe last wrote
        self._arrived = time.monotonic()  # for the latencies in /metrics
        self._status = None  # the status sent, if any
        self._tokens = None  # [prompt, cached, generated] once an answer ended (the access log)
        self._writing = threading.Lock()  # one stream chunk at a time (_side_by_side)
        # a gateway's trace id goes on the answer and the log line; else one of ours
        given = self.headers.get("X-Request-Id", "")
        self._request_id = given if REQUEST_ID.fullmatch(given) else f"req_{uuid.uuid4().hex}"
        lengths = {v.strip() for v in self.headers.get_all("Content-Length") or []}
        length = self.headers.get("Content-Length", "0").strip()
        chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
        # body bytes not read yet; -1 = unknown (chunked, or a bad header): the connection must close
        self._unread = int(length) if length.isdigit() and len(lengths) <= 1 and not chunked else -1
        self.server.dispatching(+1)
        try:
            if len(lengths) > 1:  # which one frames the body? (request smuggling): refuse and close
                raise HTTPError(400, f"conflicting Content-Length headers {sorted(lengths)}; send one")
            if self._unread < 0 and not chunked:
                raise HTTPError(400, f"invalid Content-Length header {length!r}")
            if method == "OPTIONS":
                self._preflight()
            else:
                self._route(method)()
        except HTTPError as e:
            self._fail(e)
        except (ConnectionError, TimeoutError):  # the client went away: nothing to answer
            self.close_connection = True
        except Exception:  # noqa: BLE001 - a bug: log it, answer 500, keep serving
            traceback.print_exc()
            self._fail(HTTPError(500, "internal server error; see the server log", code="internal_error"))
        finally:
            if self._chunked:
                with suppress(OSError):
                    self.connection.settimeout(self.timeout)   # the next request on this connection
            self.server.dispatching(-1)
            if self._status is not None:
                self.server.metrics.inc("edgevl_http_requests_total", route=_route_label(self.path),
                                        status=self._status)
                self._log_done(self.command or method)   # HEAD is served as GET but logged as HEAD

    def send_response(self, code, message=None):
        self._status = code
        super().send_response(code, message)
        if getattr(self, "_request_id", None):
            self.send_header("X-Request-Id", self._request_id)
        origin = self._cors_origin()
        if origin is not None:   # every answer to an allowed origin, errors and streams included
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Access-Control-Expose-Headers", "Retry-After, X-Request-Id")
            if origin != "*":
                self.send_header("Vary", "Origin")

    def _cors_origin(self) -> str | None:
        """What Access-Control-Allow-Origin says to this request: None unless it comes from a web
        page on an origin ``--allow-origin`` names (or any, with ``*``)."""
        allowed = self.server.allow_origins
        origin = getattr(self, "headers", None) and self.headers.get("Origin")
        if not allowed or not origin:
            return None
        if "*" in allowed:
            return "*"
        return origin if origin.strip().rstrip("/").lower() in allowed else None

    def _preflight(self):
        """A browser's CORS preflight (OPTIONS): allowed origins may send any method the routes
        take, with any headers (Authorization for the key, Content-Type for JSON)."""
        origin = self.headers.get("Origin")
        if not origin or not self.headers.get("Access-Control-Request-Method"):
            raise HTTPError(405, "OPTIONS answers CORS preflight requests only (with Origin and "
                            "Access-Control-Request-Method)", code="method_not_allowed", headers={"Allow": "GET, POST"})
        if self._cors_origin() is None:
            raise HTTPError(403, f"web pages from {origin} may not call this server; start it with --allow-origin "
                            f"{origin}", code="origin_not_allowed")
        self.send_response(204)
        self.send_header("Access-Control-Allow-Methods", "GET, POST")
        self.send_header("Access-Control-Allow-Headers",
                         self.headers.get("Access-Control-Request-Headers") or "Authorization, Content-Type")
        self.send_header("Access-Control-Max-Age", "600")
        self.send_header("Content-Length", "0")
        self.end_headers()
        self._sent = True

    def _fail(self, e: HTTPError):
        if self._sent:
            self.close_connection = True
            return
        if 0 < self._unread <= self.server.max_body:
            try:  # read the unused body so the connection can carry the next request
                self.rfile.read(self._unread)
                self._unread = 0
            except OSError:
                self.close_connection = True
                return
        self._send(e.status, e.body(), e.headers)

    def _send(self, status: int, obj, headers=None):
        payload = json.dumps(obj, ensure_ascii=False).encode()
        close = self._unread != 0  # a body left unread (too big, or unknown length) ends the connection
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(payload)
        self._sent = True
        if close:
            self._drain()

    def _drain(self, limit: int = 1 << 20, seconds: float = 0.5):
        """Read a little of an unread body before closing: closing a socket with unread input sends a
        reset, which can destroy the response before the client has read it."""
        self.connection.settimeout(seconds)
        try:
            while limit > 0 and (chunk := self.rfile.read1(min(limit, 1 << 16))):
                limit -= len(chunk)
        except OSError:
            pass

    def _check_key(self):
        keys = self.server.api_keys
        if not keys:
            return
        scheme, _, token = self.headers.get("Authorization", "").partition(" ")
        given = token.strip().encode()
        # every key compared, in constant time each: which key matched leaks no timing
        ok = [hmac.compare_digest(given, k.encode()) for k in keys]
        if scheme.lower() != "bearer" or not any(ok):
            raise HTTPError(401, "invalid or missing API key; send the header 'Authorization: Bearer KEY'",
                            code="invalid_api_key")

    def _read_json(self) -> dict:
        ctype = self.headers.get("Content-Type", "")
        if ctype.split(";")[0].strip().lower() != "application/json":
            raise HTTPError(415, f"Content-Type must be application/json, got {ctype or 'none'!r}",
                            code="unsupported_media_type")
        if self._unread < 0:
            raise HTTPError(411, "send the body with a Content-Length header (chunked uploads are not supported)",
                            code="length_required")
        n = self._unread
        if n > self.server.max_body:
            media = ("paths under its allowed folder (--allow-image-dir), or smaller ones" if self.server.image_dir
                     else "smaller ones (or start the server with --allow-image-dir DIR and send paths)")
            raise HTTPError(413, f"the request body is {n} bytes; the limit is {self.server.max_body}: send large "
                            f"images and videos as {media}", code="request_too_large")
        body = self.rfile.read(n)
        self._unread = 0
        if len(body) < n:
            raise ConnectionError("the client sent less than Content-Length")
        try:
            req = json.loads(body)
        except (ValueError, RecursionError) as e:
            raise HTTPError(400, f"the body is not valid JSON ({e})", code="invalid_json") from None
        if not isinstance(req, dict):
            raise HTTPError(400, "the body must be a JSON object", code="invalid_json")
        return req

    def _client_gone(self) -> bool:
        """True if the client hung up. The end of its input is not enough: a client may close
        only its sending side after the request (``nc -N``, some proxies) and still read. Only a
        write tells the two apart: a closed socket answers data with a reset, which the next
        look finds as the socket's error."""
        conn = self.connection
        try:
            if conn.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                return True
            if not _readable(conn) or conn.recv(1, socket.MSG_PEEK):
                return False  # nothing new, or the next request's bytes
            self._probe()
            return False
        except OSError:
            return True

    def _probe(self):
        """Write something the client skips, at most once a second: in a stream an SSE comment;
        before the answer an interim 100 response (HTTP/1.1 clients must accept any number of
        them). HTTP/1.0 clients may get none, so one that closed its side is taken to be reading."""
        now = time.monotonic()
        if now - self._probed < 1:
            return
        if self._chunked:
            with self._writing:
                self.wfile.write(self._frame(b": \n\n"))
        elif not self._sent and self.request_version not in ("HTTP/0.9", "HTTP/1.0"):
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self._probed = now

    # -- routes --------------------------------------------------------------------------------
    def _health(self):
        s = self.server
        # 503 while draining: a load balancer's health check takes this instance out
        self._send(503 if s.draining else 200,
                   {"status": "draining" if s.draining else "ok", "model": s.model_id, "busy": s.gate.locked(),
                    "running": s.gate.held, "slots": s.engine.parallel, "waiting": s.gate.waiting})

    def _index(self):
        self._page("index.html")

    def _page(self, name: str):
        """A file of the chat page: open without the API key, as the page must load to ask for it."""
        from .web import asset

        found = asset(unquote(name))
        if found is None:
            raise HTTPError(404, f"the chat page has no file {name!r}; open / for the page", code="unknown_route")
        body, headers = found
        self.send_response(200)
        for k, v in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)
        self._sent = True

    def _answered(self, index: int, ev) -> None:
        """An answer's last event (``_Observed``): its tokens go on the request's log line."""
        with self._writing:     # answers streamed side by side end on their own threads
            prompt, cached, made = self._tokens or (0, 0, 0)
            if index == 0:
                prompt, cached = ev.prompt_tokens, ev.prompt_tokens - ev.prefill_tokens
            self._tokens = [prompt, cached, made + ev.generation_tokens]

    def _metrics(self):
        self._check_key()
        body = self.server.metrics.render().encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self._sent = True

    def _props(self):
        from .web import props

        self._check_key()
        self._send(200, props(self.server))

    def _models(self, model_id=None):
        self._check_key()
        s = self.server
        # max_model_len: vLLM's field, which clients read for the context a model takes
        card = {"id": s.model_id, "object": "model", "created": s.created, "owned_by": "edgevl",
                "max_model_len": s.model.max_context}
        if model_id is None:
            self._send(200, {"object": "list", "data": [card]})
        elif not s.strict_model or unquote(model_id) in s.model_ids:
            self._send(200, card)
        else:
            raise HTTPError(404, f"the model {model_id!r} does not exist; this server runs {s.model_id!r}",
                            "model", "model_not_found")

    def _chat(self):
        self._check_key()
        messages, kwargs, stream, include_usage = parse_request(self._read_json(), self.server)
        try:
            self._answer(messages, kwargs, stream, include_usage)
        finally:  # answered, refused or abandoned: the request's temporary video files go now
            close_videos(messages)

    def _run(self, prompt, kwargs, streamer=None, cost: int = 0) -> list | None:
        """Each answer's events (a list per choice, ``n`` of them), once the request holds a slot;
        with ``streamer``, handed to it as an iterator per choice. None where nothing is left to
        answer. ``prompt()`` gives what ``stream_choices`` takes, made only now."""
        with self.server.gate(self._client_gone):
            if self._client_gone():
                self.close_connection = True
                return None
            with self.server.decode_budget.hold(cost, self._client_gone):
                return self._generate(prompt, kwargs, streamer)

    def _generate(self, prompt, kwargs, streamer) -> list | None:
        """``_run``'s work once the request holds a slot (and its images' memory)."""
        given = prompt()
        choices = []
        try:
            choices = [_Observed(c, i, self._arrived, self.server.metrics, self._answered) for i, c in
                       enumerate(stream_choices(self.server.model, given, engine=self.server.engine, **kwargs))]
            # template, images, prefill: errors here still get a status (the answers share
            # them: the first answer's first event tells; the others may wait for a slot)
            first = next(choices[0])
            if streamer is not None:
                streamer([chain([first], choices[0]), *choices[1:]])
                return None
            out = []
            for i, c in enumerate(choices):
                evs = [first] if i == 0 else []
                for ev in c:
                    evs.append(ev)
                    if self._client_gone():  # nobody will read the answer: free the model now
                        self.close_connection = True
                        return None
                out.append(evs)
        except (HTTPError, ConnectionError, TimeoutError):
            raise
        except Exception as e:  # noqa: BLE001 - the request's mistake, the package's fault or a bug
            raise self._generation_error(e) from None
        finally:
            for c in choices:   # an answer not read to its end stops decoding now
                c.close()
            given = None  # before the next request may decode its images
        return out

    def _answer(self, messages, kwargs, stream, include_usage):
        # pixels are decoded only once the request holds a slot and its images' memory
        # (decode_budget): waiting requests hold only their compressed bytes, however large the images
        answers = self._run(lambda: decode_images(messages, self._client_gone), kwargs,
                            (lambda choices: self._stream(choices, include_usage, kwargs.get("tools")))
                            if stream else None, decode_cost(messages))
        if answers is None:
            return
        self._send(200, {**self._head("chat.completion"),
                         "choices": [self._message(i, evs, kwargs) for i, evs in enumerate(answers)],
                         "usage": _usage([evs[-1] for evs in answers])})

    @staticmethod
    def _message(index: int, evs: list, kwargs: dict) -> dict:
        """One answer's choice of a chat completion."""
        message = {"role": "assistant", "content": "".join(e.text for e in evs)}
        finish = evs[-1].finish_reason
        spec = kwargs.get("tools")
        if spec is not None and spec.parses:    # the model's calls, in OpenAI's shape
            content, calls = tool_calls.parse(message["content"], spec)
            # as the Python API's: a call the token limit cut is never shown as text
            message["content"] = (content or None) if calls or spec.structure is not None else content
            if calls:
                message["tool_calls"] = calls
                finish = "tool_calls" if finish == "stop" else finish
        reasoning = "".join(e.reasoning for e in evs)
        if reasoning:  # the model's thinking, apart from the answer (OpenAI-compatible servers' field)
            message["reasoning_content"] = reasoning
        if evs[-1].boxes:
            message["boxes"] = [b.as_json() for b in evs[-1].boxes]
        lps = {"content": [e for ev in evs for e in ev.logprobs]} if kwargs.get("logprobs") else None
        return {"index": index, "message": message, "logprobs": lps, "finish_reason": finish}

    def _generation_error(self, e: Exception) -> HTTPError:
        """The answer to an error raised while the request held the model. The request's own
        mistakes (EdgevlError) are 400s. The package failing under the running model
        (PackageError) and bugs are the server's: a 500 in one line, one log line (a bug's
        traceback too, where it helps), and the cache is dropped, since a failed step may have
        left it half-written."""
        if isinstance(e, ShuttingDown):   # cut short by a shutdown: clients retry a 503 elsewhere
            return HTTPError(503, "the server is shutting down; send the request to another instance or retry "
                             "shortly", code="shutting_down", headers={"Retry-After": "5"})
        if isinstance(e, EdgevlError) and not isinstance(e, PackageError):
            return HTTPError(400, str(e), code="invalid_request")
        self.server.model.reset()
        if isinstance(e, PackageError):
            msg = f"the model package failed: {(str(e).splitlines() or [''])[0]}"
            print(f"edgevl: {msg}", file=sys.stderr, flush=True)
            return HTTPError(500, msg, code="package_error")
        traceback.print_exc()
        return HTTPError(500, f"internal server error ({type(e).__name__}); see the server log",
                         code="internal_error")

    def _head(self, kind: str) -> dict:
        return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": kind, "created": int(time.time()),
                "model": self.server.model_id, "system_fingerprint": None}

    def _start_events(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        if self.request_version in ("HTTP/0.9", "HTTP/1.0"):   # no chunks there: the close ends the stream
            self._framed, self.close_connection = False, True
            self.send_header("Connection", "close")
        else:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self._sent = self._chunked = True
        # a client that stops reading would hold its slot until the idle timeout: once the socket's
        # buffers are full, a write waiting this long ends the answer as a hang-up does. Not much
        # shorter: a client reading slowly sees its window reopen only after it has read half its
        # buffer (over 30 s at a few KB/s on loopback), and that must not count as a stall
        self.connection.settimeout(STALLED_STREAM)

    def _frame(self, data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data) if self._framed else data

    def _end_events(self, done: bool = True):
        if done:     # the chat and completion streams' end marker (the Responses stream has none)
            self._event(b"[DONE]")
        if self._framed:
            self.wfile.write(b"0\r\n\r\n")

    def _answers_stream(self, head: dict, choices, include_usage: bool, one, usage=None):
        """A chat or text completion stream: each answer's chunks (``one(index, events)`` sends
        them and returns the answer's last event; with ``n`` > 1 they interleave, as the answers
        decode together), then the usage chunk where asked (``usage(lasts)``) and the end. After
        the headers an error can only be a final error event."""
        self._start_events()
        if include_usage:
            head["usage"] = None  # as OpenAI: null on every chunk but the last
        try:
            lasts = [one(0, choices[0])] if len(choices) == 1 else self._side_by_side(choices, one)
        except (ConnectionError, TimeoutError):
            raise
        except Exception as e:  # noqa: BLE001 - after the headers an error can only be an event
            self._event(self._generation_error(e).body())
        else:
            if include_usage:
                self._event({**head, "choices": [], "usage": (usage or _usage)(lasts)})
        self._end_events()

    def _side_by_side(self, choices, one) -> list:
        """``one(index, events)`` of every answer at once, each on a thread of its own, so that a
        client sees the n answers grow together (as OpenAI streams them) instead of answer 2
        waiting for answer 1's end; writes take turns (``_event``). Their last events, in order;
        a client gone first among the errors, else the first error, once every answer is done."""
        lasts, errors = [None] * len(choices), []

        def run(i, events):
            try:
                lasts[i] = one(i, events)
            except BaseException as e:  # noqa: BLE001 - handed to the request's thread
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i, c), name=f"edgevl-answer-{i}", daemon=True)
                   for i, c in enumerate(choices)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise next((e for e in errors if isinstance(e, (ConnectionError, TimeoutError))), errors[0])
        return lasts

    def _stream(self, choices, include_usage: bool, tools=None):
        """The answers as chat completion chunks (each names its choice's index)."""
        head = self._head("chat.completion.chunk")
        self._answers_stream(head, choices, include_usage,
                             lambda index, events: self._stream_choice(head, index, events, tools), self._chat_usage)

    def _chat_usage(self, lasts: list) -> dict:
        """Usage, with extension fields for the chat page's stats: the server's own speeds (the
        stream's arrival times blur them) and speculative decoding's counts."""
        ev = lasts[0]
        usage = {**_usage(lasts), "timings": {"prompt_per_second": round(ev.prompt_tps, 1),
                                              "predicted_per_second": round(ev.generation_tps, 1)}}
        if self.server.model.mtp is not None:   # this request's own counts
            usage["speculative"] = {"drafted": sum(e.drafted for e in lasts),
                                    "accepted": sum(e.accepted for e in lasts)}
        return usage

    def _stream_choice(self, head: dict, index: int, events, tools):
        """One answer's chunks; returns its last event."""
        lps = []    # answer tokens' logprobs not sent yet: they ride on the next chunk of the answer

        def chunk(delta, finish=None):
            lp = None
            if lps and (finish or "content" in delta or "tool_calls" in delta):
                lp = {"content": lps[:]}
                lps.clear()
            self._event({**head, "choices": [{"index": index, "delta": delta, "logprobs": lp,
                                              "finish_reason": finish}]})

        forced = tools is not None and tools.structure is not None   # the answer is calls, never text
        chunk({"role": "assistant", "content": None if forced else ""})
        calls = tool_calls.CallStream(tools) if tools is not None and tools.parses else None

        def text(t, end=False):
            if calls is None:
                if t:
                    chunk({"content": t})
                return bool(t)
            evs = calls.feed(t, end)
            for e in evs:   # content, then each call: its name first, then its argument fragments
                if e[0] == "content":
                    chunk({"content": e[1]})
                elif e[0] == "name":
                    chunk({"tool_calls": [{"index": e[1], "id": e[2], "type": "function",
                                           "function": {"name": e[3], "arguments": ""}}]})
                else:
                    chunk({"tool_calls": [{"index": e[1], "function": {"arguments": e[2]}}]})
            return bool(evs)

        for ev in events:
            lps += ev.logprobs
            if ev.reasoning:
                chunk({"reasoning_content": ev.reasoning})
            if not text(ev.text, ev.finish_reason is not None) and not ev.reasoning and self._client_gone():
                raise ConnectionError("the client hung up")  # no write to fail on (held-back text): look
        finish = ev.finish_reason
        if calls is not None and finish == "stop" and calls.whole:
            finish = "tool_calls"
        chunk({"boxes": [b.as_json() for b in ev.boxes]} if ev.boxes else {}, finish)
        return ev

    # -- POST /v1/responses (OpenAI's Responses API, read into a chat request) ---------------------
    def _responses(self):
        self._check_key()
        req = self._read_json()
        try:
            chat, origin = responses.to_chat(req, self.server.items)
        except responses.RequestError as e:
            raise HTTPError(400, str(e), e.param) from None
        def named(e: HTTPError):   # as the request named it: input[i], not the chat reading's messages[k]
            e.args = (responses.renamed(str(e), origin),)
            e.param = e.param and responses.renamed(e.param, origin)
            return e

        try:
            messages, kwargs, stream, _ = parse_request(chat, self.server)
        except HTTPError as e:
            raise named(e) from None

        def decode():    # a clip that fails while it is decoded, named the same way
            try:
                return decode_images(messages, self._client_gone)
            except HTTPError as e:
                raise named(e) from None
        if kwargs["n"] != 1:
            close_videos(messages)
            raise HTTPError(400, "the Responses API gives one answer (n is a chat completion's field); send n "
                            "requests, which decode together", "n")
        try:
            w = responses.Writer(req, self.server.model_id, kwargs.get("tools"), self.server.items)
            if not stream:
                answers = self._run(decode, kwargs, cost=decode_cost(messages))
                if answers is None:
                    return
                evs, = answers      # the Responses API has no n: one answer
                for ev in evs:
                    w.feed(ev)
                w.finish(evs[-1])
                self._send(200, w.final)
                return

            def send(choices):
                events, = choices
                self._start_events()
                for e in w.start():
                    self._typed_event(e)
                try:
                    for ev in events:
                        out = w.feed(ev)
                        for e in out:
                            self._typed_event(e)
                        if not out and self._client_gone():
                            raise ConnectionError("the client hung up")
                except (ConnectionError, TimeoutError):
                    raise
                except Exception as e:  # noqa: BLE001 - after the headers an error can only be an event
                    err = self._generation_error(e).body()["error"]
                    self._typed_event({"type": "error", "sequence_number": w.seq, "code": err.get("code"),
                                       "message": err["message"], "param": err.get("param")})
                else:
                    for e in w.finish(ev):
                        self._typed_event(e)
                self._end_events(done=False)

            self._run(decode, kwargs, send, decode_cost(messages))
        finally:  # answered, refused or abandoned: the request's temporary video files go now
            close_videos(messages)

    # -- POST /tokenize, /detokenize (llama-server's and vLLM's) ---------------------------------------
    def _tokenize(self):
        self._check_key()
        req = self._read_json()
        ids = tokenize_request(req, self.server)
        with_pieces = req.get("with_pieces", False)
        if not isinstance(with_pieces, bool):
            raise HTTPError(400, "with_pieces must be true or false", "with_pieces")
        tok = self.server.model.tokenizer
        tokens = [{"id": i, "piece": tok.decode([i], skip_special_tokens=False)} for i in ids] if with_pieces else ids
        self._send(200, {"tokens": tokens, "count": len(ids), "max_model_len": self.server.model.max_context})

    def _detokenize(self):
        self._check_key()
        req = self._read_json()
        ids, n = req.get("tokens"), self.server.model.tokenizer.vocab_size
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n
                                                for i in ids):
            raise HTTPError(400, f"tokens must be a list of token ids from 0 to {n - 1}", "tokens")
        text = self.server.model.tokenizer.decode(ids, skip_special_tokens=False)
        self._send(200, {"content": text, "prompt": text})

    def _typed_event(self, obj: dict):
        self._event(obj, obj["type"])

    # -- POST /v1/completions (legacy text completion) --------------------------------------------
    def _completions(self):
        self._check_key()
        prompt, kwargs, stream, include_usage, echo = parse_completion(self._read_json(), self.server)
        head = {**self._head("text_completion"), "id": f"cmpl-{uuid.uuid4().hex[:24]}"}
        start = len(prompt) if echo else 0
        offsets: dict = {}      # per choice: where its next token starts (the legacy logprobs' text_offset)

        def choice(index, text, entries, finish):
            lp = None
            if kwargs["logprobs"]:
                lp = _legacy_logprobs(entries, offsets.setdefault(
                    index, TextOffsets(start, frozenset(self.server.model.tokenizer.special_tokens))))
            return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}

        if not stream:
            answers = self._run(lambda: prompt, kwargs)
            if answers is None:
                return
            self._send(200, {**head, "choices": [
                choice(i, (prompt if echo else "") + "".join(ev.text for ev in evs),
                       [e for ev in evs for e in ev.logprobs], evs[-1].finish_reason)
                for i, evs in enumerate(answers)], "usage": _usage([evs[-1] for evs in answers])})
            return

        def one(i, events):
            if echo:
                self._event({**head, "choices": [choice(i, prompt, [], None)]})
            for ev in events:
                if ev.text or ev.logprobs:
                    self._event({**head, "choices": [choice(i, ev.text, ev.logprobs, None)]})
                elif self._client_gone():
                    raise ConnectionError("the client hung up")
            self._event({**head, "choices": [choice(i, "", [], ev.finish_reason)]})
            return ev

        def send(choices):
            self._answers_stream(head, choices, include_usage, one)

        self._run(lambda: prompt, kwargs, send)

    def _event(self, obj, kind: str | None = None):
        """One server-sent event in its own chunk; ``kind``: its ``event:`` name (the Responses stream's)."""
        data = (b"event: %s\n" % kind.encode() if kind else b"") + b"data: " + (
            obj if isinstance(obj, bytes) else json.dumps(obj, ensure_ascii=False).encode()) + b"\n\n"
        with self._writing:     # answers streamed side by side write from their own threads
            self.wfile.write(self._frame(data))


def _one_malloc_arena() -> None:
    """Each request waits in its own thread, and glibc gives threads their own malloc arenas:
    pixels a thread decoded stayed in its arena once freed, so memory grew with the number of
    threads that had decoded an image (16 requests with a 10000x10000 image, decoded one at a
    time: 5.6 GB). With one arena the next request reuses the memory (peak: one image). Requests
    hold the model one at a time anyway, so the shared arena costs no parallelism."""
    try:
        ctypes.CDLL(None).mallopt(-8, 1)  # M_ARENA_MAX; no such call outside glibc: nothing to do
    except (OSError, AttributeError):
        pass


class EdgevlServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64  # the listen backlog: bursts of clients must not be dropped before the 429 logic

    def __init__(self, model: Model, host: str = "127.0.0.1", port: int = 8080, api_key=None,
                 image_dir=None, max_queue: int = 8, model_name: str | None = None, max_body: int = MAX_BODY,
                 access_log: bool = False, allow_special_in_content: bool = False,
                 max_image_patches: int | None = None, strict_model: bool = False, chat_template_kwargs=None,
                 thinking: bool | None = None, parallel: int = 4, allow_origins=None, max_tokens: int | None = None,
                 max_video_decode: float = MAX_VIDEO_DECODE_GPX):
        if not 0 <= int(port) <= 65535:
            raise EdgevlError(f"--port must be between 0 and 65535, got {port}")
        if max_queue < 0:
            raise EdgevlError(f"--max-queue must be >= 0, got {max_queue}")
        check_options(max_tokens=max_tokens, max_video_decode=max_video_decode)
        self.max_tokens = max_tokens
        self.max_video_decode = int(max_video_decode * 1e9)   # pixels of frames one request's clips may decode
        if image_dir is not None:
            image_dir = Path(image_dir).expanduser().resolve()
            if not image_dir.is_dir():
                raise EdgevlError(f"--allow-image-dir {image_dir} is not a folder")
        # one key, or several (one per app, each revocable alone)
        self.api_keys = tuple(k for k in ([api_key] if isinstance(api_key, str) else api_key or ()) if k)
        self.model, self.image_dir = model, image_dir
        self.allow_origins = _origins(allow_origins)
        self.max_body, self.access_log = int(max_body), access_log
        self.max_image_pixels = MAX_IMAGE_PIXELS   # the chat page's /props says it
        self.allow_special_in_content = allow_special_in_content
        self.max_image_patches = max_image_patches  # None: the model's own budget
        # defaults (--no-thinking: the model's own switch); a request's chat_template_kwargs override
        self.thinking = thinking
        self.chat_template_kwargs = model_template_kwargs(model, chat_template_kwargs)
        self.token_span = token_span(model.tokenizer)
        _one_malloc_arena()
        folder = Path(model.path).resolve().name
        self.model_id = model_name or folder
        self.model_ids = {self.model_id, folder}
        self.strict_model = strict_model
        from .engine import Engine

        # requests decode together in the engine's slots; the gate queues the rest
        self.engine = Engine(model, parallel)   # checks parallel before the port is taken
        self.items = responses.ItemStore()       # recent Responses answers' items (item_reference)
        self.gate = Gate(int(max_queue), parallel)
        self.decode_budget = MemoryBudget(DECODE_BUDGET)
        self.created = int(time.time())
        self.metrics = server_metrics(self)
        self.draining = False
        self.drained = None     # after a drain: whether every request ended within the grace
        self._active, self._active_changed = 0, threading.Condition()   # requests being answered
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            super().__init__((host, int(port)), Handler)
        except OSError as e:
            where = f"{host}:{port}"
            if e.errno == errno.EADDRINUSE:
                raise EdgevlError(f"port {port} on {host} is already in use; stop what uses it or pass "
                                  "another --port") from None
            if e.errno == errno.EACCES:
                raise EdgevlError(f"no permission to listen on {where} (ports below 1024 need privileges); "
                                  "pass another --port") from None
            raise EdgevlError(f"cannot listen on {where}: {e.strerror or e}; check --host and --port") from None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def handle_error(self, request, client_address):
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            return  # a client hanging up mid-request is not a server problem
        super().handle_error(request, client_address)

    def stop(self):
        self.shutdown()
        self.server_close()

    def dispatching(self, step: int) -> None:
        with self._active_changed:
            self._active += step
            self._active_changed.notify_all()

    def wait_answered(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the requests being answered to end (after ``server_close``,
        those the stop cut write their 503 or error event); True when none is left."""
        with self._active_changed:
            return self._active_changed.wait_for(lambda: self._active <= 0, seconds)

    def drain(self, grace: float) -> bool:
        """Stop gracefully (SIGTERM): new generation requests get 503 and /health 503 at once;
        the requests under way and those already queued run on for up to ``grace`` seconds; then
        ``serve_forever`` returns. True when every one of them ended within ``grace``."""
        self.draining = True
        deadline = time.monotonic() + grace
        while (self.gate.held or self.gate.waiting) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.drained = not (self.gate.held or self.gate.waiting)   # before serve_forever returns
        self.shutdown()
        return self.drained

    def server_close(self):
        super().server_close()
        self.engine.close()


def check_options(max_tokens=None, allow_origins=None, shutdown_grace: float = 0.0,
                  max_video_decode: float = MAX_VIDEO_DECODE_GPX) -> None:
    """The server's own limits, checked before a model loads (``edgevl serve``): one-line errors."""
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise EdgevlError(f"--max-tokens must be a whole number >= 1, got {max_tokens!r}")
    if not (isinstance(max_video_decode, (int, float)) and 0 < max_video_decode < math.inf):
        raise EdgevlError(f"--max-video-decode must be a number of gigapixels > 0, got {max_video_decode!r}")
    if not shutdown_grace >= 0:
        raise EdgevlError(f"--shutdown-grace must be >= 0 seconds, got {shutdown_grace}")
    _origins(allow_origins)


def _origins(given) -> frozenset:
    """``--allow-origin`` values as the Origin header spells them (scheme://host[:port], lower
    case), or "*"; anything else is a one-line error."""
    out = set()
    for o in given or ():
        o = str(o).strip().rstrip("/").lower()
        if o != "*":
            parts = urlsplit(o)
            if parts.scheme not in ("http", "https") or not parts.netloc or parts.path or parts.query:
                raise EdgevlError(f"--allow-origin takes an origin such as http://localhost:3000 (scheme, host and "
                                  f"port, no path) or '*', got {o!r}")
        out.add(o)
    return frozenset(out)


def make_server(model, host: str = "127.0.0.1", port: int = 0, threads: int | None = None,
                **options) -> tuple[EdgevlServer, threading.Thread]:
    """Start a server in a background thread (port 0 = a free port; see ``server.url``);
    ``model`` is a package path or a loaded Model. Stop it with ``server.stop()``."""
    if not isinstance(model, Model):
        model = load(model, threads=threads)
    model.preload()     # first requests as fast as later ones (e.g. an MoE's experts)
    server = EdgevlServer(model, host, port, **options)
    thread = threading.Thread(target=server.serve_forever, name="edgevl-server", daemon=True)
    thread.start()
    return server, thread


def memory_line(server) -> str:
    """What the slots may take beside the weights: each holds one sequence's state, which
    grows with its tokens up to the context, and the snapshots of its recurrent state."""
    engine, model = server.engine, server.model
    weights = sum(p.stat().st_size for p in Path(model.path).iterdir() if p.is_file())
    each = engine.state_bytes()
    images = model.image_cache.limit if model.vision is not None else 0
    return (f"edgevl: {engine.parallel} slot{'s' if engine.parallel > 1 else ''} (--parallel) x up to "
            f"{each / 2**20:.0f} MB of state each at the full {model.max_context}-token context (prefix "
            f"snapshots included), "
            + (f"{images / 2**20:.0f} MB of encoded images (--image-cache-mb), " if images else "")
            + f"beside the package's {weights / 2**20:.0f} MB on disk: up to "
            f"{(weights + engine.parallel * each + images) / 2**20:.0f} MB")


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def api_keys_from(keys=None, key_file=None, env=None) -> list[str]:
    """The keys ``edgevl serve`` requires: ``--api-key`` (repeatable), the lines of
    ``--api-key-file`` (blank lines and # comments skipped), else ``EDGEVL_API_KEY`` (``env``).
    A key file keeps keys out of the process list, where any user of the machine sees arguments."""
    out = [k for k in keys or () if k]
    if key_file is not None:
        try:
            text = Path(key_file).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise EdgevlError(f"cannot read --api-key-file {key_file} ({getattr(e, 'strerror', None) or e}); "
                              "give a text file with one key per line") from None
        found = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
        if not found:
            raise EdgevlError(f"--api-key-file {key_file} holds no key; put one key per line")
        out += found
    if not out and env:
        out = [env]
    bad = [k for k in out if any(c.isspace() for c in k) or not k.isprintable()]
    if bad:
        raise EdgevlError("an API key may not hold spaces or control characters (clients send it in one header); "
                          "check --api-key, --api-key-file and EDGEVL_API_KEY")
    return out


def serve(model_path, host: str = "127.0.0.1", port: int = 8080, api_key=None,
          threads: int | None = None, image_dir=None, max_queue: int = 8, model_name: str | None = None,
          allow_special_in_content: bool = False, max_image_patches: int | None = None,
          strict_model: bool = False, chat_template_kwargs=None, thinking: bool | None = None,
          parallel: int = 4, shutdown_grace: float = 30.0, allow_origins=None,
          max_tokens: int | None = None, max_video_decode: float = MAX_VIDEO_DECODE_GPX) -> int:
    """Serve until Ctrl-C, or SIGTERM (``EdgevlServer.drain``: the requests under way get up to
    ``shutdown_grace`` seconds to end; a second SIGTERM stops at once): the ``edgevl serve`` command."""
    check_options(max_tokens, allow_origins, shutdown_grace, max_video_decode)
    model = model_path if isinstance(model_path, Model) else load(model_path, threads=threads)
    model.preload(progress=True)
    server = EdgevlServer(model, host, port, api_key=api_key, image_dir=image_dir, max_queue=max_queue,
                          model_name=model_name, access_log=True, allow_special_in_content=allow_special_in_content,
                          max_image_patches=max_image_patches, strict_model=strict_model,
                          chat_template_kwargs=chat_template_kwargs, thinking=thinking, parallel=parallel,
                          allow_origins=allow_origins, max_tokens=max_tokens, max_video_decode=max_video_decode)
    if not api_key and "*" in server.allow_origins:
        print("warning: --allow-origin '*' without --api-key: any web page open in a browser that can reach this "
              "port can use the model", file=sys.stderr)
    if not api_key and not _is_loopback(host):
        print(f"warning: listening on {host} without --api-key: anyone who can reach this port can use the model",
              file=sys.stderr)
    print(f"edgevl: serving {server.model_id} at {server.url}/v1 (Ctrl-C to stop)", flush=True)
    # a wildcard address listens everywhere: a browser on this machine opens it at loopback
    page = server.url.replace("//0.0.0.0:", "//127.0.0.1:").replace("//[::]:", "//[::1]:")
    print(f"edgevl: chat page at {page}/", flush=True)
    print(memory_line(server), flush=True)
    def on_term(signum, frame):
        if server.draining:     # a second SIGTERM: stop now
            raise KeyboardInterrupt
        print(f"edgevl: SIGTERM: finishing the requests under way (up to {shutdown_grace:g} s), refusing new ones "
              "(503)", file=sys.stderr, flush=True)
        # not on this thread: it runs serve_forever, which drain's shutdown() waits for
        threading.Thread(target=server.drain, args=(shutdown_grace,), name="edgevl-drain", daemon=True).start()

    installed = threading.current_thread() is threading.main_thread()   # signals reach only that thread
    previous = signal.signal(signal.SIGTERM, on_term) if installed else None
    try:
        server.serve_forever()
        if server.drained is not None:
            print("edgevl: every request ended; stopped" if server.drained else
                  f"edgevl: stopped after {shutdown_grace:g} s with requests still under way", file=sys.stderr)
    except KeyboardInterrupt:
        print("\nedgevl: shutting down", file=sys.stderr)
    finally:
        if installed:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        server.server_close()
        # the requests the stop cut end now with a 503 (an error event in a stream): let their
        # threads write it before the process exits and takes them with it
        server.wait_answered(CUT_ANSWER_SECONDS)
    return 0
