"""A loaded package: tokenizer, embedding, decoder graph, lm_head and (for VLMs) the vision graph.

``Model.generate_tokens`` is the low-level loop every front end (API, CLI, chat, server) uses.
Everything model-specific comes from the package's architecture (``edgevl.models``): the decoder
driver and its per-layer state, rotary positions, the vision encoder, output post-processing.

The model keeps one decoder state (cache): a new request that starts with the tokens already in
the cache (a chat's next turn) prefills only the new tokens. Attention KV state can be cut back
to any length; recurrent state only to a snapshot taken at the end of an earlier prompt, so
prefix reuse goes back to the longest shared prefix the cache can return to, and never carries
recurrent state across a prefix that does not match exactly.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import numpy as np

from . import models, speculative
from .blocks.vocabulary import SPECULATIVE_OPTIONS
from .errors import EdgevlError
from .models.protocol import PackageView
from .owner import Lease
from .package import check_listed, package_path, read_manifest, verify_files
from .processing.image import load_image
from .runtime import Embedding, LMHead, Net, SectionedNet, check_threads, default_threads, trim_heap
from .sample import Sampler, sample
from .tokenizer import Tokenizer

# Prompts longer than this are prefilled in chunks (``prefill_chunk`` load option): activation
# memory grows with the chunk, and 512 was no slower than 2048 on any benchmark package (a
# hybrid delta-rule model's 1000-token prefill: 0.24 GB of activations against 0.40-0.50 GB;
# docs/benchmarks.md, section 6).
PREFILL_CHUNK = 512
RELEASE_TRIM_BYTES = 64 << 20
# encoded images (and video files) kept for the next request that sends the same one again (a chat
# client resends the whole conversation, its image included, every turn), ``image_cache_mb`` load
# option: a 384x384 image's rows take 0.6 MB at the 0.8B shape
IMAGE_CACHE_MB = 64


class PromptChunk(NamedTuple):
    """One forward of a prompt (:meth:`Model.prompt_chunks`): its rows' embeddings [S, H],
    rotary positions [axes, S] and token ids, and the KV length the whole prompt reaches
    (``kv_hint`` of ``Decoder.forward``; 0 for a prompt of one chunk)."""
    embeds: np.ndarray
    positions: np.ndarray
    ids: list
    kv_hint: int


class ImageCache:
    """Encoded images and videos (the vision tower's rows and processor info), by the digest of an
    image's pixels and its patch limit or of a video file's bytes and its sampling options, least
    recently used first out, within ``limit`` bytes of rows (0: keeps none). Used on the model's
    owner thread only (``holds`` looks from any thread)."""

    def __init__(self, limit: int):
        self.limit, self.bytes, self.hits, self.misses = int(limit), 0, 0, 0
        self._items: dict = {}

    def holds(self, key) -> bool:
        return key in self._items       # one dict lookup: atomic in CPython, moves nothing

    def get(self, key):
        hit = self._items.pop(key, None)
        if hit is None:
            self.misses += 1
            return None
        self._items[key] = hit          # the most recent last
        self.hits += 1
        return hit

    def put(self, key, rows: np.ndarray, info) -> None:
        if rows.nbytes > self.limit:
            return
        rows.flags.writeable = False    # shared by every request that sends the image
        self._items[key] = (rows, info)
        self.bytes += rows.nbytes
        self.trim()

    def trim(self) -> None:
        while self.bytes > self.limit:
            rows, _ = self._items.pop(next(iter(self._items)))
            self.bytes -= rows.nbytes


def _pixels_digest(image) -> str:
    """A digest of an RGB image's pixels, read a strip of rows at a time: a whole copy of a
    10000x10000 picture (300 MB) beside its decoded pixels would double its memory."""
    h = hashlib.sha1()
    w, rows = image.size
    step = max(1, (1 << 20) // w)
    for y in range(0, rows, step):
        h.update(image.crop((0, y, w, min(rows, y + step))).tobytes())
    return h.hexdigest()


def _file_digest(video) -> str | None:
    """A digest of a video file's bytes, for a regular file given by its path (the API's and the
    command line's) or as an open file (the server's copy of a data: URL); None for anything else
    (frames, a folder of frames, a path the server still has to check against its folder)."""
    from .processing.video import VideoFile
    from .weights import sha256_file

    if isinstance(video, VideoFile):
        if video.file is None:
            return None
        h, fd, at = hashlib.sha256(), video.file.fileno(), 0
        while chunk := os.pread(fd, 8 << 20, at):     # not moving the file's position
            h.update(chunk)
            at += len(chunk)
        return h.hexdigest()
    if not isinstance(video, (str, os.PathLike)) or not os.path.isfile(video):   # no FIFO, no device
        return None
    return sha256_file(video)


def _as_list(v) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in (v if isinstance(v, (list, tuple)) else [v])]


def _config_ids(v) -> list[int]:
    """A config's token id or list of them (null: none), integers only."""
    ids = [] if v is None else v if isinstance(v, list) else [v]
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
        raise ValueError(f"token ids must be integers, got {v!r:.60}")
    return ids


def _on_owner(fn):
    """Run the method on the model's owner thread (edgevl.owner): every ncnn call of a model
    runs on the thread that loaded its nets."""
    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        owner = self.__dict__.get("_owner")
        return fn(self, *args, **kwargs) if owner is None else owner.call(fn, self, *args, **kwargs)
    return call


def check_model(model) -> None:
    """The API's first argument is a loaded model (a path there is a common slip)."""
    if not hasattr(model, "generate_tokens"):
        raise EdgevlError(f"expected a model from edgevl.load(), got {type(model).__name__} {str(model)!r:.60}; "
                          "load it first: model = edgevl.load(PATH)")


def shared_prefix(a, b) -> int:
    """How many leading items ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _read_generation_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        raise EdgevlError(f"{path} is not valid JSON; fix or delete it (it only sets generation defaults)") from None
    if not isinstance(cfg, dict):
        raise EdgevlError(f"{path} must hold a JSON object")
    return cfg


class Model:
    """A loaded package. Its ncnn work runs on the process's ncnn thread (``edgevl.owner``), which
    loaded its nets; the methods may be called from any thread. ``close()`` lets go of that
    thread (the last model to let go ends it) and later calls are refused; a model that is
    dropped lets go too."""

    def __init__(self, path, threads: int | None = None, verify: bool = True, light_mode: bool = True,
                 low_memory: bool = False, options: dict | None = None):
        self.low_memory = low_memory
        owner = Lease()
        try:
            owner.call(self._load, path, threads, verify, light_mode, options)
        except BaseException:
            owner.close()
            raise
        self._owner = owner
        # the model lets go of the thread when it goes; the finalizer holds the lease, never the
        # model (not waiting: the collector may run it on any thread)
        self._finalizer = weakref.finalize(self, owner.close, False)
        self._finalizer.atexit = False   # a daemon thread: exiting never waits for a generation
        self._engines = weakref.WeakSet()   # close() closes them (edgevl.engine.Engine)

    def close(self) -> None:
        """Let go of the ncnn thread once this model's queued calls have run (the thread ends
        with the last model holding it); the model refuses every later call that needs it.
        Also ``with edgevl.load(...) as model:``. Its engines (``edgevl.engine.Engine``) close first."""
        for engine in list(self._engines):
            engine.close()
        self._owner.close()

    def __reduce__(self):
        # its nets live in this process's ncnn thread; pickle's own message names a weakref
        raise TypeError("a loaded model cannot be pickled or sent to another process; "
                        "call edgevl.load in each process instead")

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _load(self, path, threads, verify, light_mode, options):
        try:
            self._init(path, threads, verify, light_mode, options)
        except KeyError as e:
            raise EdgevlError(f"{path}: manifest.json lacks {e}; the package comes from another edgevl "
                              "version — convert the model again") from None
        except (TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError) as e:
            # a manifest entry of the wrong type or value that the generic checks do not cover
            raise EdgevlError(f"{path}: manifest.json has a malformed entry ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}); convert the model again") from None

    def _init(self, path, threads, verify, light_mode, options):
        self.path = Path(path)
        self.manifest = m = read_manifest(self.path)
        if verify:
            verify_files(self.path, m)
        check_listed(self.path, m)  # nothing beside the graphs is read unverified
        self.arch = models.get(m["architecture"])
        self._nets: list = []   # every Net opened for this model (release_buffers)
        options = dict(options or {})
        spec = {k: options.pop(k, None) for k in SPECULATIVE_OPTIONS}
        # the architecture's load-time options (Architecture.runtime_options), checked
        self.options = self.arch.resolve_runtime_options(options)
        self.config = m["config"]
        self.dtype = m["dtype"]
        self.threads = check_threads(threads) if threads is not None else default_threads()
        self.tokenizer = Tokenizer(self.path, fallback_template=self.arch.chat_template,
                                   processor=self.arch.has_vision_tower(self.config))

        graphs = m["graphs"]
        self.max_context = int(m["context"])
        # what the architecture sees of this package (never the whole model)
        self.package = PackageView(self.path, m, self.options, self.threads, self.dtype, self.open_net)
        self.decoder = self.arch.make_decoder(self.package, self._net("decoder", light_mode))
        self.head = LMHead(self._net("lm_head"), graphs["lm_head"])
        e = m["embedding"]
        self.embedding = Embedding(str(package_path(self.path, e["file"], m, "embedding file")), e["segments"],
                                   e["rows"], e["dim"], e["dtype"])
        self.vocab_size = int(e["rows"])

        # the checkpoint's own generation defaults (sampling, eos), copied into the package
        self.generation_config = _read_generation_config(self.path / "generation_config.json")
        # the tokens that end an answer, as transformers' generate takes them: the generation
        # config's list, else the model config's (its text config's where the top level has none:
        # vision-language configs keep it there)
        text = self.config.get("text_config")
        sources = (self.generation_config, self.config, text if isinstance(text, dict) else {})
        lists = [_config_ids(c.get("eos_token_id")) for c in sources]    # each read, so a bad one is named
        self.eos_ids = set(next((ids for ids in lists if ids), []))
        if not self.eos_ids and self.tokenizer.eos_token:
            tid = self.tokenizer.token_to_id(self.tokenizer.eos_token)
            if tid is not None:
                self.eos_ids.add(tid)

        self.image_token_id = m.get("image_token_id")
        self.video_token_id = m.get("video_token_id")
        self.vision = (self.arch.make_vision(self.package, self._net("vision", light_mode)) if "vision" in graphs
                       else None)
        self.image_cache = ImageCache(int(self.options.get("image_cache_mb", IMAGE_CACHE_MB)) << 20)

        self.cache = self.decoder.new_cache()
        self.cache_keys: list = []  # one hashable key per cached position (token id or image row)
        self.last_prefill_tokens = 0
        # the decoder's last hidden state at each length the cache can go back to (the MTP
        # block's row before a reused prefix needs it)
        self._hidden_at: dict[int, np.ndarray] = {}
        self._generations = 0       # generations started (the last one owns the cache)
        self.mtp = None
        has_mtp = "mtp" in graphs and not self.low_memory
        undo = self.decoder.undo_rows if has_mtp or spec["speculative"] == "mtp" else 0
        mode, k, vocab, adaptive = speculative.check_options(spec["speculative"], spec["draft_tokens"],
                                                             spec["draft_vocab"], has_mtp, undo,
                                                             speculative.missing_block(m, self.low_memory))
        if mode == "mtp":
            self.mtp = speculative.Mtp(self, k, vocab, adaptive)

    @property
    def family(self) -> str:
        return self.arch.name

    @functools.cached_property
    def undo_limit(self) -> int:
        """The most rows of one forward the decoder can take back afterwards (0: none; a
        low-memory model runs plain steps only): a verify pass's bound."""
        return 0 if self.low_memory else self.decoder.undo_rows

    def runtime_stats(self) -> dict:
        """What the runtime measured beyond speed (e.g. an expert cache's hit rate):
        {name: {..., "summary": one line}}; with speculative decoding ``speculative``:
        {"drafted", "accepted"} of the last generation."""
        stats = dict(self.arch.runtime_stats(self.package))
        if self.mtp is not None:
            d, a = self.mtp.drafted, self.mtp.accepted
            stats["speculative"] = {"drafted": d, "accepted": a,
                                    "summary": f"speculative decoding (MTP, {'up to ' if self.mtp.adaptive else ''}"
                                               f"{self.mtp.k} draft token{'s' if self.mtp.k > 1 else ''}): "
                                               f"{a} of {d} drafts accepted"
                                               + (f" ({a / d:.0%})" if d else "")}
        return stats

    @property
    def speculative(self) -> str:
        """"mtp" when generation drafts with the package's MTP block, else "none"."""
        return "none" if self.mtp is None else "mtp"

    @_on_owner
    def preload(self, progress: bool = False) -> Model:
        """Load what the model would otherwise load on first use (an MoE's routed experts kept all
        resident; see ``Architecture.preload``): a server's first requests then run as fast as
        later ones. Returns the model."""
        self.arch.preload(self.package, progress=progress)
        return self

    def _net(self, name: str, light_mode: bool = True) -> Net:
        return self.open_net(name, light_mode=light_mode)

    @_on_owner
    def open_net(self, name: str, dtype: str | None = None, light_mode: bool = True, packing: bool = True,
                 threads: int | None = None) -> Net:
        """One of the package's graphs (``name``.param/.bin, listed and verified), in the package's
        precision and thread count unless told otherwise; architectures open their helper nets with it."""
        dtype = dtype or (self.dtype if self.dtype != "q8" else "bf16")
        threads = threads or self.threads
        sections = (self.manifest["graphs"].get(name) or {}).get("extra", {}).get("sections")
        param, binfile = (str(package_path(self.path, f"{name}{x}", self.manifest, "graph file"))
                          for x in (".param", ".bin"))
        if self.low_memory and light_mode and sections and packing:
            for sec in sections:
                package_path(self.path, sec["param"], self.manifest, "section file")
            return SectionedNet(str(self.path), binfile, sections, threads, dtype)
        net = Net(param, binfile, threads, dtype, light_mode, packing)
        self._nets.append(net)
        return net

    @_on_owner
    def release_buffers(self) -> None:
        """Return the activation buffers a prompt left pooled in the model's nets (they scale
        with the prompt; decoding needs a small fraction). Prefill calls it. The C heap goes
        back to the system only when 64 MB or more are free: a short prompt's buffers stay
        there for the next one (every fresh page costs a fault: trimming after each 128-token
        prompt made the next prefill 7 % slower here)."""
        for net in self._nets:
            net.release()
        trim_heap(RELEASE_TRIM_BYTES)

    @property
    def kv_elem_bytes(self) -> int:
        return 2 if self.dtype in ("bf16", "q8") else 4

    @property
    def prefill_step(self) -> int:
        """The most rows a prompt's forward takes at once (``prefill_chunk``)."""
        return int(self.options.get("prefill_chunk") or PREFILL_CHUNK)

    # -- inputs -------------------------------------------------------------------------------
    @property
    def _vision_pads(self) -> list:
        """The image and video placeholder ids (the rows the vision tower fills)."""
        return [t for t in (self.image_token_id, self.video_token_id) if t is not None]

    def _vision_mask(self, ids: np.ndarray) -> np.ndarray:
        return np.isin(ids, self._vision_pads)

    def embed(self, input_ids: list[int], image_rows: list[np.ndarray] = ()) -> np.ndarray:
        """Token embeddings with image- and video-token rows replaced in prompt order by the
        rows of the images and videos."""
        x = self.embedding(input_ids)
        mask = self._vision_mask(np.asarray(input_ids))
        n_pad = int(mask.sum())
        n_rows = sum(int(r.shape[0]) for r in image_rows)
        if n_pad != n_rows:
            what = ("image/video tokens but the image(s) and video(s)" if self.video_token_id in input_ids
                    else "image tokens but the image(s)")
            raise EdgevlError(f"the prompt has {n_pad} {what} produce {n_rows} embedding rows; expand each "
                              "placeholder to its token count")
        if n_rows:
            x[mask] = np.concatenate(image_rows, 0)
        return x

    @_on_owner
    def encode_image(self, image, max_image_patches: int | None = None):
        """(rows [tokens, hidden], processor info) for one image. The same pixels at the same
        patch limit are encoded once while ``image_cache`` keeps them (the rows are then read-only)."""
        if self.vision is None:
            raise EdgevlError("this model has no vision tower; it cannot take images")
        if self.image_cache.limit <= 0:
            self.image_cache.misses += 1
            return self.vision(image, max_image_patches)
        image = load_image(image)
        return self._cached((_pixels_digest(image), image.size, max_image_patches),
                            lambda: self.vision(image, max_image_patches))

    def _cached(self, key, encode) -> tuple:
        """``encode()``'s (rows, info), or what the image cache kept of it under ``key``."""
        t0 = time.perf_counter()
        hit = self.image_cache.get(key)
        if hit is None:
            rows, info = encode()
            self.image_cache.put(key, rows, info)
            return rows, dict(info)
        rows, info = hit
        # an info's encoding time (a video's "seconds") is this call's: the lookup's
        return rows, {**info, **({"seconds": time.perf_counter() - t0} if "seconds" in info else {})}

    @property
    def takes_video(self) -> bool:
        return self.video_token_id is not None and hasattr(self.vision, "encode_video")

    @_on_owner
    def encode_video(self, video, fps: float | None = None, max_frames: int | None = None,
                     max_pixels: int | None = None):
        """(rows [tokens, hidden], processor info) for one clip: a file, a folder of frames, a
        list of frames, or ``{"frames": [...], "fps": N}`` (docs/video.md)."""
        if not self.takes_video:
            raise EdgevlError("this model has no vision tower; it takes no video" if self.vision is None else
                              f"this model ({self.arch.name}) takes no video; send a few frames as images")
        digest = self.video_digest(video)
        if digest is None:      # frames in memory, a folder of frames, a path under the server's rules
            self.image_cache.misses += 1    # asked for and not held, as an image with the cache off
            return self.vision.encode_video(video, fps, max_frames, max_pixels)
        return self._cached(("video", digest, fps, max_frames, max_pixels),
                            lambda: self.vision.encode_video(video, fps, max_frames, max_pixels))

    def video_digest(self, video) -> str | None:
        """The key of a clip's file in the encoding cache (None: not cached)."""
        from .processing.video import DecodedVideo

        if self.image_cache.limit <= 0:
            return None
        return video.digest if isinstance(video, DecodedVideo) else _file_digest(video)

    def video_cached(self, digest: str | None, fps=None, max_frames=None, max_pixels=None) -> bool:
        """Whether the encoding cache holds this clip (from any thread: a look, nothing moved)."""
        return digest is not None and self.image_cache.holds(
            ("video", digest, fps, max_frames, max_pixels))

    def video_tokens(self, video, fps: float | None = None, max_frames: int | None = None,
                     max_pixels: int | None = None, max_decode: int | None = None) -> int:
        """Prompt tokens a clip will take, from its header alone (nothing decoded): per temporal
        patch its pads, its start and end tokens and its ``<T seconds>`` text."""
        if not self.takes_video:
            raise EdgevlError("this model has no vision tower; it takes no video" if self.vision is None else
                              f"this model ({self.arch.name}) takes no video; send a few frames as images")
        return self.vision.video_tokens(video, fps, max_frames, max_pixels,
                                        count_text=lambda s: len(self.tokenizer.encode(s)), max_decode=max_decode)

    def positions(self, input_ids, images=()) -> np.ndarray:
        """Rotary positions [axes, len(input_ids)] of a whole prompt (images: processor infos of
        its images and videos in prompt order). A video's temporal patches are laid out as
        images of one frame each, its video tokens as image tokens (timestamps separate them)."""
        ids, infos = list(input_ids), []
        if self.video_token_id is not None and self.image_token_id is not None:
            ids = [self.image_token_id if t == self.video_token_id else t for t in ids]
        for info in images:
            if isinstance(info, dict) and info.get("kind") == "video":
                t, h, w = info["grid_thw"]
                infos += [{**info, "grid_thw": (1, h, w)}] * int(t)
            else:
                infos.append(info)
        return np.asarray(self.arch.positions(ids, infos, self.image_token_id), np.int64)

    # -- the decoding loop --------------------------------------------------------------------
    @_on_owner
    def logits(self, hidden: np.ndarray) -> np.ndarray:
        return self.head(hidden)

    def reset(self) -> None:
        self.cache = self.decoder.new_cache()
        self.cache_keys = []
        self._hidden_at = {}
        if self.mtp is not None:
            self.mtp.reset()

    def note_hidden(self, hidden_row: np.ndarray) -> None:
        """Remember the decoder's hidden state at the cache's current length (kept only where the
        cache can go back to: its snapshots, and its end)."""
        if self.mtp is None:
            return
        keep = set(self.cache._snapshots)
        self._hidden_at = {n: h for n, h in self._hidden_at.items() if n in keep}
        self._hidden_at[self.cache.length] = np.array(hidden_row, np.float32).reshape(-1)

    def _keys(self, input_ids, image_rows) -> list:
        keys, img, k = [], 0, 0
        digests = [hashlib.sha1(np.ascontiguousarray(r).tobytes()).hexdigest() for r in image_rows]
        pads = set(self._vision_pads)
        for t in input_ids:
            if t in pads and image_rows:
                while img < len(image_rows) and k >= image_rows[img].shape[0]:
                    img, k = img + 1, 0
                keys.append(("img", digests[img] if img < len(digests) else "", k))
                k += 1
            else:
                keys.append(int(t))
        return keys

    @_on_owner
    def prefill(self, input_ids: list[int], image_rows: list[np.ndarray] = (), reuse_cache: bool = True,
                images=()) -> np.ndarray:
        """Feed the prompt (only what the cache lacks); returns the last position's logits.

        ``images`` are the processor infos of the prompt's images (architectures whose positions
        depend on image grids need them)."""
        chunks = self.prompt_chunks(input_ids, image_rows, reuse_cache, images)
        chunk = next(chunks)
        while True:
            try:
                hidden, _ = self.decoder.forward(chunk.embeds, self.cache, chunk.positions, ids=chunk.ids,
                                                 kv_hint=chunk.kv_hint)
            except BaseException:
                chunks.close()      # the cache goes back to as whole as before the prompt
                raise
            try:
                chunk = chunks.send(hidden)
            except StopIteration as done:
                last = done.value
                break
        logits = self.logits(last[None])[0]
        if self.last_prefill_tokens > 1:
            self.release_buffers()
        return logits

    def prompt_chunks(self, input_ids: list[int], image_rows: list[np.ndarray] = (), reuse_cache: bool = True,
                      images=()):
        """:meth:`prefill` as a generator (owner thread), for a caller that runs the forwards
        itself (``edgevl.engine`` computes several prompts' chunks and other requests' decode
        rows in one ``Decoder.forward_rows``): it yields a :class:`PromptChunk` for each chunk
        of the prompt, to be run on ``self.cache`` as it is when yielded, and is sent that
        chunk's hidden states; it returns the last position's hidden state (the caller takes
        the logits, so several prompts' can go through one lm_head call). Between chunks the
        model may run other work on other caches; a generator closed before the end leaves
        the cache as whole as before it."""
        if len(input_ids) == 0:
            raise EdgevlError("the prompt is empty; pass some text")
        if len(input_ids) >= self.max_context:
            fix = ""
            if self.video_token_id is not None and self.video_token_id in input_ids:
                fix = " (or send a shorter video or lower --fps, --max-frames or --video-max-pixels)"
            elif self.image_token_id is not None and self.image_token_id in input_ids:
                fix = " (or use a smaller image)"
            # the answer needs a position too: a prompt as long as the context leaves none
            raise EdgevlError(f"the prompt has {len(input_ids)} tokens, but this model's maximum context length is "
                              f"{self.max_context} tokens (the prompt must be shorter, to leave room for the "
                              f"answer); shorten the prompt{fix}")
        x = self.embed(list(input_ids), image_rows)
        keys = self._keys(input_ids, image_rows)
        positions = self.positions(input_ids, images)
        start = 0
        if reuse_cache and self.cache_keys:
            n = shared_prefix(self.cache_keys, keys)
            # at least one token must run to give logits; recurrent state only goes back to a snapshot
            start = self.cache.rollback_point(min(n, len(keys) - 1))
        if start == 0:
            self.reset()
        else:
            self.cache.rollback(start)
            self.cache_keys = self.cache_keys[:start]
        hidden, hiddens = None, []
        before = self._hidden_at.get(start) if start else None   # h[start - 1], for the MTP block
        # runs end at the architecture's snapshot points (where a later prompt may diverge from
        # this one, e.g. before an answer that the next turn's template renders differently)
        points = {p for p in self.arch.snapshot_points(self.tokenizer, list(input_ids)) if start < p < len(keys)}
        step = self.prefill_step
        cuts = sorted(points | set(range(start + step, len(keys), step)) | {len(keys)})
        # the whole prompt's KV room at once: regrowing it chunk by chunk left the freed smaller
        # caches as heap holes (a 2B model, a 1000-token prompt in 512-token chunks: 0.84 -> 0.45
        # GB of prefill memory)
        hint = len(keys) if len(cuts) > 1 else 0
        with self._whole_or_nothing():
            s = start
            for e in cuts:
                hidden = yield PromptChunk(x[s:e], positions[:, s:e], input_ids[s:e], hint)
                if e in points:
                    self.cache.snapshot()
                    self.note_hidden(hidden[-1])
                if self.mtp is not None:
                    hiddens.append(hidden)
                s = e
            self.cache.snapshot()  # the end of a prompt: where the next turn of a chat starts from
            self.cache_keys.extend(keys[start:])
        self.note_hidden(hidden[-1])
        if self.mtp is not None:
            # the block's rows from start - 1 on wait for the prompt's next token (row j: x[j + 1], h[j])
            self.mtp.keep_before(start - 1)
            h = np.concatenate(hiddens)
            if before is not None:
                self.mtp.add(x[start:], np.concatenate([before[None], h]), positions[:, start - 1:], start - 1)
            else:
                self.mtp.add(x[start + 1:], h, positions[:, start:], start)
        self.last_prefill_tokens = len(keys) - start
        return hidden[-1]

    @_on_owner
    def step(self, token: int) -> np.ndarray:
        pos = np.full((1, 1), self.cache.next_position, np.int64)
        with self._whole_or_nothing():
            # no ids: a decoded token's row is always a text embedding, whatever its id
            hidden, _ = self.decoder.forward(self.embedding([token]), self.cache, pos)
            self.cache_keys.append(int(token))
        return self.logits(hidden)[0]

    @contextmanager
    def _whole_or_nothing(self):
        """The cache either takes a whole prefill or step or is left as whole as before it: an
        exception or a Ctrl-C inside a forward (an expert read failing, a notebook interrupt)
        would leave earlier layers' recurrent state advanced while the length is not, and the
        next prompt reusing the cache would silently continue from a state no prompt produced."""
        length = self.cache.length
        try:
            yield
        except BaseException:
            kept = self.cache.recover(min(length, len(self.cache_keys)))
            del self.cache_keys[kept:]
            if self.mtp is not None:
                self.mtp.keep_before(kept - 1)
            raise

    def generate_tokens(self, input_ids, max_new_tokens: int = 256, image=None, temperature: float = 0.0,
                        top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0,
                        seed: int | None = None, stop_ids=None, reuse_cache: bool = True,
                        max_image_patches: int | None = None, ignore_eos: bool = False,
                        constraint=None, presence_penalty: float = 0.0,
                        frequency_penalty: float = 0.0, logprobs=None, logit_bias=None,
                        min_p: float = 0.0) -> Iterator[int]:
        """Yield new token ids (temperature 0 = greedy); stops at eos, ``stop_ids`` or the context end.

        ``input_ids`` must already hold each image's expanded placeholder run; ``image`` is a
        path / PIL image / image file's bytes, or a list of them in prompt order (or ``(rows, info)`` pairs as
        ``encode_image`` returns them; bare row arrays work for 1-D-position models).
        The loop runs on the owner thread one token per request (it never runs ahead of the
        consumer); a consumer that stops early releases the thread for the next call.
        ``logprobs`` (``edgevl.sample.Logprobs``): notes each token taken with its log-probability.
        ``logit_bias``: OpenAI's, {token id: -100..100} added to the logits before sampling.
        ``min_p``: drop tokens less likely than ``min_p`` times the likeliest (after top-p).
        """
        # the Sampler's settings, by name: it is made inside the generator, on the owner thread
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                        seed=seed, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                        logprobs=logprobs, logit_bias=logit_bias, min_p=min_p)
        gen = self._exclusive(self._generate_tokens(input_ids, max_new_tokens, image, sampling, stop_ids,
                                                    reuse_cache, max_image_patches, ignore_eos, constraint))
        owner = self.__dict__.get("_owner")
        return gen if owner is None else owner.stream(gen)

    def _exclusive(self, gen: Iterator[int]) -> Iterator[int]:
        """``gen`` as the model's running generation. Generations share the model's one cache, so
        one resumed after another started (whose prompt replaced the cache) would go on from the
        other's state: it stops with an error instead of giving a wrong answer."""
        self._generations += 1
        mine = self._generations
        try:
            for tok in gen:
                yield tok
                if self._generations != mine:
                    raise EdgevlError("another generation started on this model before this one ended (they "
                                      "share its cache): read one to its end or close it first, or decode "
                                      "several together with edgevl.engine.Engine")
        finally:
            gen.close()

    def _generate_tokens(self, input_ids, max_new_tokens, image, sampling: dict, stop_ids, reuse_cache,
                         max_image_patches, ignore_eos, constraint) -> Iterator[int]:
        if max_new_tokens is None or int(max_new_tokens) < 0:
            raise EdgevlError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        input_ids = [int(t) for t in input_ids]
        sampler = Sampler(**sampling, prompt_tokens=len(input_ids))
        rows, infos = self.encode_images(image, max_image_patches)
        stops = (set() if ignore_eos else self.eos_ids) | set(_as_list(stop_ids))
        logits = self.prefill(input_ids, rows, reuse_cache, images=infos)
        history = list(input_ids)
        if self.mtp is not None and int(max_new_tokens) > 0:
            yield from speculative.generate(self, self.mtp, sampler, logits, history, stops, int(max_new_tokens),
                                            constraint)
            return
        left = int(max_new_tokens)
        while left > 0:
            tok = sample(sampler, constraint, logits, history)
            left -= 1
            yield tok
            while True:
                if tok in stops or len(self.cache_keys) + 1 >= self.max_context:  # total length = context
                    return
                history.append(tok)
                jump = speculative.forced(self, constraint, left, len(self.cache_keys))
                if not jump:
                    break
                # the grammar forces the next tokens: one pass takes them and gives the one after
                emit, end = speculative.cycle(self, None, sampler, tok, history, stops, left, None, constraint,
                                              jump)
                yield from emit
                history += emit[:-1]
                left -= len(emit)
                if end or left <= 0:
                    return
                tok = emit[-1]
            logits = self.step(tok)

    @_on_owner
    def encode_images(self, image, max_image_patches=None) -> tuple[list, list]:
        """(rows per image, processor info per image) for ``image`` as generate_tokens takes it."""
        if image is None:
            return [], []
        images = image if isinstance(image, (list, tuple)) else [image]
        rows, infos = [], []
        for im in images:
            if isinstance(im, tuple):
                r, info = im
            elif isinstance(im, np.ndarray):
                r, info = im, None
            else:
                r, info = self.encode_image(im, max_image_patches)
            rows.append(np.asarray(r, np.float32))
            infos.append(info)
        return rows, infos


def load(path=None, threads: int | None = None, verify: bool = True, low_memory: bool = False,
         options: dict | None = None, **runtime_options) -> Model:
    """Load a converted package folder; ``path`` None or ``"demo"`` (unless a package folder named
    demo is in the working folder) is the shipped demo model, as in every command (converted once
    into the user cache, ``EDGEVL_CACHE``).

    ``low_memory=True`` keeps no weights resident: each decoder layer / lm_head shard is loaded
    only while it runs (much slower; for models that do not fit in RAM).
    ``options`` / keyword arguments: load-time options — ``speculative`` ("mtp": draft with the
    package's multi-token-prediction block, the default where it has one; "none"),
    ``draft_tokens`` (drafts per decoder pass, 1 to 7; default: up to 3, as many as pay),
    ``draft_vocab`` (draft among the first N vocabulary entries only) — and the architecture's
    own, e.g. ``expert_cache_mb=512`` for mixture-of-experts models (``edgevl run --help`` lists
    them).
    """
    from .demo import demo_package, is_demo_package, names_demo

    if names_demo(path):
        path = demo_package()
    try:
        return Model(path, threads=threads, verify=verify, low_memory=low_memory,
                     options={**(options or {}), **runtime_options})
    except EdgevlError as e:
        # the demo's cached package: nobody can convert it by hand; clearing the cache does
        if "convert the model again" in str(e) and is_demo_package(path):
            raise EdgevlError(str(e).replace("convert the model again", "run `edgevl cache clear` (the demo is "
                                             "converted again at its next use)")) from None
        raise


def check_load_options(path, low_memory: bool = False, options: dict | None = None, video: bool = False,
                       images: bool = False) -> None:
    """What ``load(path, low_memory=..., options=...)`` would refuse in the options (and a video,
    ``video``, for a package that takes none; images, ``images``, for one without a vision tower), read
    from the manifest alone: commands call it
    before they draw a scene, write an output or load. The draft-token limit depends on the loaded
    decoder and is checked by ``load`` itself."""
    m = read_manifest(Path(path))
    if images and "vision" not in (m.get("graphs") or {}):   # before a demo scene is drawn and saved
        raise EdgevlError("this model has no vision tower; it cannot take images")
    try:
        _check_load_options(m, low_memory, options, video)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError):
        pass   # a malformed manifest: load says so in its own words


def _check_load_options(m: dict, low_memory: bool, options: dict | None, video: bool) -> None:
    arch = models.get(m["architecture"])
    options = dict(options or {})
    spec = {k: options.pop(k, None) for k in SPECULATIVE_OPTIONS}
    arch.resolve_runtime_options(options)
    decoder = m["graphs"]["decoder"]
    if low_memory and decoder.get("passes") and (decoder.get("extra") or {}).get("sections"):
        raise EdgevlError(f"low-memory mode does not support {arch.name}'s decoder yet (only decoders without "
                          "recurrent layers; README's known limits name them); run without --low-memory")
    has_mtp = "mtp" in m["graphs"] and not low_memory
    speculative.check_options(spec["speculative"], spec["draft_tokens"], spec["draft_vocab"], has_mtp,
                              1 << 30 if has_mtp else 0, speculative.missing_block(m, low_memory))
    if video and m.get("video_token_id") is None:
        raise EdgevlError(f"this model ({arch.name}) takes no video; send a few frames as images"
                          if "vision" in m["graphs"] else "this model has no vision tower; it takes no video")
