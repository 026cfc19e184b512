"""The model protocol: everything generic code may ask of an architecture.

Generic modules (convert, model, runtime, generate, chat, server, verify, bench, cli) never name
a model family; they hold an :class:`Architecture` (from ``edgevl.models.get``/``resolve``) and
ask it. An architecture module subclasses it and exports one instance as ``ARCH``.

What an architecture decides, in the order data flows:

- ``convert``: the package's graphs, embedding table and per-layer state, from a checkpoint
  (streamed tensor by tensor; see ``models/base.py``), plus its own ``options`` (e.g. a cache
  layout) that the CLI offers as flags;
- ``chat_template``: a built-in template for checkpoints that ship none;
- ``make_vision``: the image processor + vision graph driver (None for text models);
- ``positions``: the rotary positions of a prompt (1-D, or per axis for M-RoPE), from its
  token ids and the grids of its images; decoding continues at max(last position) + 1;
- ``rope``: cos/sin tables for those positions, as the decoder graph expects them;
- ``make_decoder``: the decoder driver (the generic ``runtime.Decoder`` fits any graph whose
  state is declared in the manifest; ``hooks`` lets it run host work between graph passes);
- ``snapshot_points``: positions inside a prompt where the decoder state is worth keeping for
  the next prompt (models with recurrent state can only go back to such points);
- ``reasoning_tokens``: the markers around the model's thinking (hidden from answers by default);
- ``output_processor``: post-processing of the generated text, streamed (e.g. grounding
  coordinates rescaled to the original images), with structured results (:class:`Box` list);
- ``reference``: the PyTorch model it is verified against (transformers' class where one
  exists), behind the small :class:`Reference` interface ``verify``/``bench``/tests use;
- ``make_tiny``/``tiny_variants``: random tiny checkpoints with the real layout, for the
  conformance suite in ``tests/arch/``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import EdgevlError


@dataclass(frozen=True)
class Option:
    """A conversion option an architecture offers (``edgevl convert --NAME VALUE``)."""
    choices: tuple
    default: str
    help: str = ""
    label: str = "{value} {name}"   # how benchmark tables name a non-default value


@dataclass(frozen=True)
class RuntimeOption:
    """A load-time setting an architecture offers: ``edgevl.load(path, NAME=value)`` and
    ``--NAME`` on the commands that load a model (e.g. how much of a model to keep resident).
    Values are numbers of ``type`` (int or float), at least ``minimum`` if given."""
    type: type = float
    help: str = ""
    metavar: str = "N"
    minimum: float | None = None


# load-time options of every architecture (the runtime, not a model family, acts on them)
COMMON_RUNTIME_OPTIONS = {
    "prefill_chunk": RuntimeOption(
        int, "prompt tokens per prefill run (default 512): activation memory grows with it; "
             "lower it to fit a long prompt in less RAM", "TOKENS", 1),
}


# llama.cpp's GGUF type for each package dtype (q8: per-row int8 against q8_0's 32-blocks)
GGUF_OF_DTYPE = {"bf16": "bf16", "fp16": "f16", "fp32": "f32", "q8": "q8_0"}


class Architecture:
    name: str = ""                 # the manifest's "architecture"; also the registry key
    options: dict = {}             # conversion options: name -> Option
    runtime_options: dict = {}     # load-time options: name -> RuntimeOption (Model.options)
    chat_template: str | None = None
    has_vision: bool = False       # takes images (make_vision returns an encoder)
    # (start, end) marker tokens around the model's reasoning, e.g. ("<think>", "</think>"):
    # generation returns that text apart from the answer (``Event.reasoning``)
    reasoning_tokens: tuple | None = None
    # extra arguments for llama.cpp's convert_hf_to_gguf.py when ``edgevl bench --compare llamacpp``
    # converts this architecture's checkpoints (e.g. leaving out parts edgevl does not run either)
    llamacpp_convert_args: tuple = ()
    tiny_variants: dict = {}       # name -> overrides for make_tiny (conformance suite)
    # The share of teacher-forced rows the conformance suite lets fall below its reduced-precision
    # logit-cosine bar. 0 for smooth models; an architecture with discrete per-token choices
    # (mixture-of-experts routing) flips a near-tied choice under bf16/q8 rounding now and then,
    # which moves that one row's logits far while the others stay close.
    precision_outlier_rows: float = 0.0

    # -- conversion ------------------------------------------------------------------------------
    def resolve_options(self, given: dict) -> dict:
        """Defaults filled in; unknown names or values are a one-line error."""
        out = {}
        for k, v in given.items():
            if v is None:
                continue
            if k not in self.options:
                raise EdgevlError(f"{self.name} models have no conversion option {k!r}"
                                  + (f" (they have: {', '.join(self.options)})" if self.options else ""))
            if v not in self.options[k].choices:
                raise EdgevlError(f"{k} must be one of {', '.join(self.options[k].choices)}, got {v!r}")
            out[k] = v
        return {k: out.get(k, o.default) for k, o in self.options.items()}

    def convert(self, ckpt, out: Path, dtype: str, options: dict, on_tensor) -> dict:
        """Write the package files into ``out``; return the manifest parts (``graphs``,
        ``embedding``, ``context``, ``image_token_id`` ...)."""
        raise NotImplementedError

    # -- runtime ---------------------------------------------------------------------------------
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
                raise EdgevlError(f"{self.name} models have no option {k!r} ({flag}); they have: {', '.join(known)}")
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

    def llamacpp_type(self, manifest: dict) -> str | None:
        """The GGUF type at this package's precision, for ``edgevl bench --compare llamacpp``
        (``bench.gguf_for`` names; None: llama.cpp has none)."""
        return GGUF_OF_DTYPE.get(manifest.get("dtype"))

    def runtime_stats(self, model) -> dict:
        """What the running model measured about itself beyond speed, as {name: {...,
        "summary": one line}} (e.g. an expert cache's hit rate): ``run --verbose`` prints the
        summaries, ``bench`` writes the rest to its JSON."""
        return {}

    def preload(self, model, progress: bool = False) -> None:
        """Load now what the model would otherwise load when first used (e.g. every routed
        expert of a mixture-of-experts model kept all resident), so that first requests are as
        fast as later ones: ``serve`` calls it before it listens, ``bench`` inside the timed
        load. Nothing to do for most models."""

    def make_decoder(self, model, net):
        from ..runtime import Decoder

        info = model.manifest["graphs"]["decoder"]
        return Decoder(net, info, self.rope(info), self.hooks(model))

    def hooks(self, model) -> dict:
        """Host functions the decoder graph's ``passes`` name (see runtime.Decoder); a pass
        naming a state gets it as ``state=`` (e.g. a ``host`` state such as a recurrent matrix
        updated by a helper net the architecture opens with ``model.open_net``)."""
        return {}

    def rope(self, info: dict) -> Callable:
        """positions [axes, seq] -> (cos, sin) as the decoder graph's rope inputs want them."""
        raise NotImplementedError

    def positions(self, input_ids, images, image_token_id) -> np.ndarray:
        """Rotary positions [axes, len(input_ids)] of a whole prompt (images: processor infos)."""
        return np.arange(len(input_ids), dtype=np.int64)[None]

    def make_vision(self, model, net):
        return None

    def snapshot_points(self, model, input_ids: list) -> list[int]:
        """Lengths inside a prompt at which prefill also snapshots the decoder state (besides the
        prompt's end). Recurrent state cannot be cut back, so prefix reuse returns only to a
        snapshot: a model whose chat template re-renders earlier answers differently from how
        they were generated (e.g. without their reasoning) names the points before each answer,
        so the next turn prefills only from there."""
        return []

    def output_processor(self, model, images: list) -> "OutputProcessor | None":
        """None, or an :class:`OutputProcessor` for one answer to a prompt with these images
        (their processor infos, in prompt order)."""
        return None

    # -- verification ----------------------------------------------------------------------------
    def reference(self, ref_dir, dtype: str = "fp32") -> "Reference":
        raise EdgevlError(f"{self.name} has no PyTorch reference to verify against")

    # -- tests -----------------------------------------------------------------------------------
    def make_tiny(self, folder, variant: str = "default", seed: int = 0, dtype: str = "fp32",
                  train_steps: int = 0) -> Path:
        raise NotImplementedError


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


class Reference:
    """A PyTorch model behind the interface verify, bench and the conformance suite use.

    ``images`` are what ``prepare_images`` returns for the package's processor infos;
    states are [input embeddings, after each decoder layer ..., after the final norm]."""

    has_vision = False

    def prepare_images(self, images: list, infos: list):
        """Reference-side image inputs for ``images`` (paths/PIL), given the package's infos."""
        raise EdgevlError("this reference takes no images")

    def processor_diff(self, images, infos) -> float | None:
        """max |pixel difference| of the package's processor vs the reference one, if any."""
        return None

    def vision_states(self, images) -> tuple:
        """(merger rows, [after each vision layer ..., post norm]) for each image, in order."""
        raise NotImplementedError

    def text_states(self, ids, images=None) -> tuple[list, np.ndarray]:
        """(states, logits [len(ids), V])."""
        raise NotImplementedError

    def start(self, ids, images=None):
        """Prefill: (last-position logits [V], state)."""
        raise NotImplementedError

    def step(self, token: int, state):
        """One decode step: (logits [V], state)."""
        raise NotImplementedError

    def state_bytes(self, state) -> int:
        return _tensor_bytes(state)

    def state_arrays(self, state) -> dict:
        """{(layer, name): array} of a prefilled state's fixed-size parts (conv windows, recurrent
        matrices), named as the package's manifest names them (``Cache.state_arrays``)."""
        return {}

    def greedy(self, ids, n: int, eos=(), images=None) -> list[int]:
        out = []
        logits, state = self.start(ids, images)
        for _ in range(n):
            t = int(np.argmax(logits))
            out.append(t)
            if t in eos:
                break
            logits, state = self.step(t, state)
        return out


def _tensor_bytes(obj, seen=None) -> int:
    """Bytes of the tensors a transformers cache holds (keys, values, conv/recurrent states)."""
    import torch

    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(x, seen) for x in obj)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(x, seen) for x in obj.values())
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("transformers"):
        return sum(_tensor_bytes(x, seen) for x in vars(obj).values())
    return 0


class TransformersCausalLM(Reference):
    """A transformers decoder-only model (``model.model.layers``, ``model.model.norm``)."""

    def __init__(self, model):
        self.model = model

    def _layers(self):
        return self.model.model.layers

    def _norm(self):
        return self.model.model.norm

    def text_states(self, ids, images=None):
        import torch

        outs = []
        hooks = [layer.register_forward_hook(lambda m, i, o: outs.append(o[0] if isinstance(o, tuple) else o))
                 for layer in self._layers()]
        try:
            with torch.no_grad():
                r = self.model(torch.tensor([list(ids)]), output_hidden_states=True)
                final = self._norm()(outs[-1])
        finally:
            for h in hooks:
                h.remove()
        states = [r.hidden_states[0][0].numpy()] + [o[0].numpy() for o in outs] + [final[0].numpy()]
        return states, r.logits[0].float().numpy()

    def start(self, ids, images=None):
        import torch

        with torch.no_grad():
            r = self.model(torch.tensor([list(ids)]), use_cache=True)
        return r.logits[0, -1].float().numpy(), _cache_of(r)

    def step(self, token, state):
        import torch

        with torch.no_grad():
            r = self.model(torch.tensor([[int(token)]]), cache=state, use_cache=True)
        return r.logits[0, -1].float().numpy(), _cache_of(r)


def _cache_of(r):
    return r.cache if hasattr(r, "cache") else r.past_key_values


TORCH_DTYPES = ("fp32", "bf16")


def torch_dtype(name: str):
    import torch

    if name not in TORCH_DTYPES:
        raise EdgevlError(f"reference dtype must be one of {', '.join(TORCH_DTYPES)}, got {name!r}")
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
