"""The vocabulary that shared blocks and model families both use to say what a model offers:
conversion options (``Option``), load-time options (``RuntimeOption``) and what ``edgevl bench
--compare llamacpp`` needs (``BenchProfile``, ``GGUF_OF_DTYPE``).

It lives with the blocks because blocks sit below the families (``edgevl.models``) and import
nothing from them; ``edgevl.models.protocol`` re-exports it for the families and generic code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Option:
    """A conversion option an architecture offers (``edgevl convert --NAME VALUE``)."""
    choices: tuple
    default: str
    help: str = ""
    label: str = "{value} {name}"   # how benchmark tables name a non-default value
    # a two-choice option offered as one switch instead (``--no-mtp``): it sets the other choice
    flag: str = ""
    # benchmark tables leave the default value unnamed
    quiet_default: bool = False

    @property
    def flag_value(self) -> str:
        return next(c for c in self.choices if c != self.default)


@dataclass(frozen=True)
class RuntimeOption:
    """A load-time setting an architecture offers: ``edgevl.load(path, NAME=value)`` and
    ``--NAME`` on the commands that load a model (e.g. how much of a model to keep resident).
    Values are numbers of ``type`` (int or float), at least ``minimum`` if given."""
    type: type = float
    help: str = ""
    metavar: str = "N"
    minimum: float | None = None


# load options of the runtime itself, beside every architecture's own: speculative decoding
SPECULATIVE_OPTIONS = ("speculative", "draft_tokens", "draft_vocab")


# llama.cpp's GGUF type for each package dtype (q8: per-row int8 against q8_0's 32-blocks)
GGUF_OF_DTYPE = {"bf16": "bf16", "fp16": "f16", "fp32": "f32", "q8": "q8_0"}


@dataclass(frozen=True)
class BenchProfile:
    """What ``edgevl bench --compare llamacpp`` needs of an architecture."""
    # extra arguments for llama.cpp's convert_hf_to_gguf.py (e.g. leaving out parts edgevl does not run)
    convert_args: tuple = ()
    # config.json -> more such arguments where they depend on the checkpoint (None: none)
    convert_args_of: Callable | None = None
    # GGUF tensor-name patterns of parts a package stores apart from the rest, which llama.cpp's
    # counterpart may quantize apart too (``bench.gguf_for``): part -> regex
    parts: dict = field(default_factory=dict)
    # manifest -> the GGUF type at the package's precision (None: llama.cpp has none)
    type_of: Callable = lambda manifest: GGUF_OF_DTYPE.get(manifest.get("dtype"))
