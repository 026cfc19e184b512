"""The model protocol: everything generic code may ask of an architecture, by role.

Generic modules (convert, model, runtime, generate, chat, server, bench, cli) never name a model
family; they hold an :class:`Architecture` (from ``edgevl.models.get``/``resolve``) and ask it. A
family folder (``edgevl/models/<family>/``) subclasses it and exports one instance as ``ARCH``.

Roles, in the order data flows:

- **conversion**: ``options`` (flags of ``edgevl convert``) and ``convert``, which writes the
  package's graphs, embedding table and per-layer state from a checkpoint streamed tensor by
  tensor (``edgevl/blocks/base.py``);
- **runtime**, given a :class:`PackageView` (the package's manifest, files, options, threads
  and ``open_net``), never the whole loaded model: ``runtime_options`` (load-time settings),
  ``make_decoder``/``hooks`` (the decoder driver and host work between graph passes),
  ``rope``/``positions`` (rotary tables and the positions of a prompt), ``make_vision`` (the
  image processor and vision graph driver), ``snapshot_points`` (where recurrent state is worth
  keeping for the next prompt), ``output_processor`` (post-processing of the streamed answer,
  e.g. grounding boxes), ``runtime_stats``/``preload``;
- **prompting**: ``chat_template`` (a built-in template for checkpoints that ship none),
  ``reasoning_tokens`` (the markers around the model's thinking), ``template_switches`` (its
  chat template's boolean arguments) and ``thinking_args`` (the template arguments that turn
  thinking on or off);
- **benchmark profile**: ``bench`` (:class:`BenchProfile`), what ``edgevl bench --compare
  llamacpp`` needs to build llama.cpp's counterpart of a package.

Verification (the PyTorch reference and tiny checkpoints) is not part of it: it lives in
``edgevl/verification/``, which imports the models and is never imported by them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# the vocabulary blocks share lives below them; its users keep importing it from here
from ..blocks.vocabulary import GGUF_OF_DTYPE as GGUF_OF_DTYPE
from ..blocks.vocabulary import SPECULATIVE_OPTIONS, BenchProfile, Option, RuntimeOption
from ..errors import EdgevlError

# the vision tower's precision, a conversion option of every architecture with a tower
VISION_OPTION = Option(
    ("auto", "q8", "float"), "auto",
    "the vision tower's matrix products: q8 = int8 weights, activations quantized per row at run time "
    "(ncnn's int8 Gemm; faster, see docs/benchmarks.md); float = the package's float type (bf16 in q8 "
    "packages); auto = q8 in q8 packages, float in the others", label="vision {value}", quiet_default=True)


def vision_quantized(dtype: str, choice: str) -> bool:
    """Whether a package of ``dtype`` converted with ``--vision choice`` has an int8 tower."""
    return choice == "q8" or (choice == "auto" and dtype == "q8")


# load-time options of every architecture (the runtime, not a model family, acts on them)
COMMON_RUNTIME_OPTIONS = {
    "prefill_chunk": RuntimeOption(
        int, "prompt tokens per prefill run (default 512): activation memory grows with it; "
             "lower it to fit a long prompt in less RAM", "TOKENS", 1),
    "image_cache_mb": RuntimeOption(
        int, "encoded images and video files kept, so a request that sends the same one again (a chat's "
             "next turn) skips the vision tower (default 64; 0: none)", "MB", 0),
}


@dataclass
class PackageView:
    """What an architecture sees of a loaded package: its folder, manifest, load-time options,
    thread count and dtype, ``open_net`` for its graphs, ``file`` for its other files (listed and
    inside the package), and ``resources`` for what the architecture keeps per loaded package
    (e.g. an expert store)."""
    path: Path
    manifest: dict
    options: dict
    threads: int
    dtype: str
    open_net: Callable              # (name, dtype=None, packing=True) -> runtime.Net
    resources: dict = field(default_factory=dict)

    def file(self, name: str, what: str = "file") -> Path:
        from ..package import package_path

        return package_path(self.path, name, self.manifest, what)


class Architecture:
    name: str = ""                 # the manifest's "architecture"; also the registry key
    has_vision: bool = False       # takes images (make_vision returns an encoder)

    # -- conversion ------------------------------------------------------------------------------
    options: dict = {}             # conversion options: name -> Option

    def resolve_options(self, given: dict) -> dict:
        """Defaults filled in; unknown names or values are a one-line error."""
        out = {}
        for k, v in given.items():
            if v is None:
                continue
            if k not in self.options:
                flag = "--" + k.replace("_", "-")   # the command line's spelling beside the API's
                raise EdgevlError(f"{self.name} models have no conversion option {k!r} ({flag})"
                                  + (f" (they have: {', '.join(self.options)})" if self.options else ""))
            if v not in self.options[k].choices:
                raise EdgevlError(f"{k} must be one of {', '.join(self.options[k].choices)}, got {v!r}")
            out[k] = v
        return {k: out.get(k, o.default) for k, o in self.options.items()}

    def has_vision_tower(self, config: dict) -> bool:
        """Whether a checkpoint with this config.json has a vision tower to convert (a family's
        tower, where it has one, is described by ``vision_config``)."""
        return self.has_vision and bool(config.get("vision_config"))

    def convert(self, ckpt, out: Path, dtype: str, options: dict, on_tensor) -> dict:
        """Write the package files into ``out``; return the manifest parts (``graphs``,
        ``embedding``, ``context``, ``image_token_id`` ...)."""
        raise NotImplementedError

    # -- prompting -------------------------------------------------------------------------------
    chat_template: str | None = None
    # (start, end) marker tokens around the model's reasoning, e.g. ("<think>", "</think>"):
    # generation returns that text apart from the answer (``Event.reasoning``)
    reasoning_tokens: tuple | None = None
    # chat template arguments that are switches: their values must be JSON booleans (a template
    # reads the string "false" as true)
    template_switches: tuple = ()

    def thinking_args(self, thinking: bool | None) -> dict:
        """The chat template arguments that turn the model's thinking on or off (``--thinking`` /
        ``--no-thinking``); None: the template's own default. Models that cannot switch: {}."""
        return {}

    # -- runtime ---------------------------------------------------------------------------------
    runtime_options: dict = {}     # load-time options: name -> RuntimeOption (Model.options)

    def all_runtime_options(self) -> dict:
        """Every model's load-time options (``COMMON_RUNTIME_OPTIONS``) and this architecture's."""
        return {**COMMON_RUNTIME_OPTIONS, **self.runtime_options}

    def resolve_runtime_options(self, given: dict) -> dict:
        """The load-time options that were given (None = not given), checked: an option this
        architecture does not have, or a value of the wrong type or range, is a one-line error."""
        out = {}
        known = self.all_runtime_options()
        for k, v in (given or {}).items():
            if v is None:
                continue
            opt = known.get(k)
            if opt is None:
                flag = "--" + k.replace("_", "-")
                every = [*known, *SPECULATIVE_OPTIONS]   # load() takes these beside
                raise EdgevlError(f"{self.name} models have no option {k!r} ({flag}); they have: {', '.join(every)}")
            try:
                if isinstance(v, bool) or (opt.type is int and isinstance(v, float) and not v.is_integer()):
                    raise ValueError
                val = opt.type(v)
                if val != val or val in (float("inf"), float("-inf")):
                    raise ValueError
            except (TypeError, ValueError):
                raise EdgevlError(f"{k} must be a number ({opt.type.__name__}), got {v!r:.40}") from None
            if opt.minimum is not None and val < opt.minimum:
                raise EdgevlError(f"{k} must be >= {opt.minimum:g}, got {val:g}")
            out[k] = val
        return out

    def make_decoder(self, pkg: PackageView, net):
        from ..runtime import Decoder

        info = pkg.manifest["graphs"]["decoder"]
        return Decoder(net, info, self.rope(info), self.hooks(pkg))

    def hooks(self, pkg: PackageView) -> dict:
        """Host functions the decoder graph's ``passes`` name (see runtime.Decoder); a pass
        naming a state gets it as ``state=`` (e.g. a ``host`` state such as a recurrent matrix
        updated by a helper net the architecture opens with ``pkg.open_net``)."""
        return {}

    def rope(self, info: dict) -> Callable:
        """positions [axes, seq] -> (cos, sin) as the decoder graph's rope inputs want them."""
        raise NotImplementedError

    def positions(self, input_ids, images, image_token_id) -> np.ndarray:
        """Rotary positions [axes, len(input_ids)] of a whole prompt (images: processor infos)."""
        return np.arange(len(input_ids), dtype=np.int64)[None]

    def make_vision(self, pkg: PackageView, net):
        """The vision encoder (None: no images): called with an image, it returns (rows, processor
        info). An encoder that also has ``encode_video(clip, fps, max_frames, max_pixels)`` and
        ``video_tokens(clip, fps, max_frames, max_pixels, count_text)`` (prompt tokens from the
        clip's header alone; ``count_text`` counts a text's tokens) takes video, when the manifest
        has a ``video_token_id``; its video info has ``kind: "video"``, ``grid_thw``, ``timestamps``
        and ``tokens_per_frame``."""
        return None

    def snapshot_points(self, tokenizer, input_ids: list) -> list[int]:
        """Lengths inside a prompt at which prefill also snapshots the decoder state (besides the
        prompt's end). Recurrent state cannot be cut back, so prefix reuse returns only to a
        snapshot: a model whose chat template re-renders earlier answers differently from how
        they were generated (e.g. without their reasoning) names the points before each answer,
        so the next turn prefills only from there."""
        return []

    def output_processor(self, images: list) -> OutputProcessor | None:
        """None, or an :class:`OutputProcessor` for one answer to a prompt with these images
        (their processor infos, in prompt order)."""
        return None

    def runtime_stats(self, pkg: PackageView) -> dict:
        """What the running model measured about itself beyond speed, as {name: {...,
        "summary": one line}} (e.g. an expert cache's hit rate): ``run --verbose`` prints the
        summaries, ``bench`` writes the rest to its JSON."""
        return {}

    def preload(self, pkg: PackageView, progress: bool = False) -> None:
        """Load now what the model would otherwise load when first used (e.g. every routed
        expert of a mixture-of-experts model kept all resident), so that first requests are as
        fast as later ones: ``serve`` calls it before it listens, ``bench`` inside the timed
        load. Nothing to do for most models."""

    # -- benchmark profile -----------------------------------------------------------------------
    bench: BenchProfile = BenchProfile()


class OutputProcessor:
    """Post-processing of one answer's text, streamed, with structured results at the end.

    ``feed`` takes each new piece of decoded text and returns the text to show now (it may hold
    back the start of a construct it cannot rewrite yet); ``flush`` returns what is held back at
    the end. ``boxes(shown)`` lists the regions of the prompt's images the answer names, as
    :class:`edgevl.boxes.Box` tuples in original-image pixels, for the boxes that lie within the
    first ``shown`` characters of the text returned (a stop string may cut the answer short).
    """

    def feed(self, text: str) -> str:
        return text

    def flush(self) -> str:
        return ""

    def boxes(self, shown: int | None = None) -> list:
        return []


def marker_points(tokenizer, input_ids: list, cache, after=(), before=()) -> list[int]:
    """The lengths right after each occurrence in ``input_ids`` of a marker in ``after`` (e.g.
    the chat template's opening of an assistant turn) and right before each of one in ``before``,
    sorted; ``cache`` (a ``weakref.WeakKeyDictionary``) keeps the markers' ids per tokenizer."""
    known = cache.setdefault(tokenizer, {})
    ids, out = list(input_ids), set()
    for text, shift in [(t, True) for t in after] + [(t, False) for t in before]:
        if text not in known:
            known[text] = tokenizer.encode(text)
        head = known[text]
        n = len(head)
        if n:
            out.update(i + n * shift for i, t in enumerate(ids) if t == head[0] and ids[i:i + n] == head)
    return sorted(out)


VISION_END = "<|vision_end|>"   # the token that closes an image or video in the prompt


def turn_points(tokenizer, input_ids: list, cache, user_header: str, answer_header: str) -> list[int]:
    """``snapshot_points`` for a chat template with turn headers, where prefix reuse should land
    (recurrent state goes back only to a snapshot): after each ``answer_header`` (a template that
    re-renders an earlier answer without its reasoning makes a conversation's next turn first
    differ there), before each ``user_header`` (another conversation with the same system prompt)
    and after each ``<|vision_end|>`` (another question about the same image)."""
    return marker_points(tokenizer, input_ids, cache, after=(answer_header, VISION_END), before=(user_header,))
