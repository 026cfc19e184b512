"""The architecture registry: config.json's ``model_type`` / ``architectures`` -> the module that
knows the model (it exports ``ARCH``, an :class:`edgevl.models.protocol.Architecture`).

Modules are imported only when asked for, so a new architecture costs nothing until used.
Adding one: write ``edgevl/models/<name>.py`` and add one row here (docs/adding-a-model.md).
"""

from __future__ import annotations

import importlib

from ..errors import EdgevlError

# module (and package name), the model_type values it converts, the HF architectures strings
_TABLE = (
    ("youtu", ("youtu",), ("YoutuForCausalLM",)),
    ("youtu_vl", ("youtu_vl",), ("YoutuVLForConditionalGeneration",)),
    # text-only checkpoints (Qwen3_5ForCausalLM, model_type qwen3_5_text) hold the same decoder
    ("qwen3_5", ("qwen3_5", "qwen3_5_text"), ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM")),
    ("qwen3_5_moe", ("qwen3_5_moe", "qwen3_5_moe_text"),
     ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM")),
    # the Youtu MoE hybrid: no public checkpoint yet, model_type and layout assumed (youtu_moe_layout.py)
    ("youtu_moe", ("youtu_vl_moe",), ("YoutuVLMoEForConditionalGeneration",)),
)


def names() -> list[str]:
    return [row[0] for row in _TABLE]


def get(name: str):
    """The Architecture registered under ``name`` (a package manifest's ``architecture``)."""
    for module, _, _ in _TABLE:
        if module == name:
            return importlib.import_module(f"{__name__}.{module}").ARCH
    raise EdgevlError(f"architecture {name!r} is not known to this edgevl (it knows {', '.join(names())}); "
                      "upgrade edgevl or convert the model again")


def resolve(config: dict):
    """The Architecture for a checkpoint's config.json (model_type first, then architectures)."""
    mt = config.get("model_type")
    for module, model_types, _ in _TABLE:
        if isinstance(mt, str) and mt in model_types:
            return get(module)
    archs = config.get("architectures")
    archs = archs if isinstance(archs, list) else []
    for module, _, hf_archs in _TABLE:
        if any(a in hf_archs for a in archs if isinstance(a, str)):
            return get(module)
    supported = ", ".join(t for row in _TABLE for t in row[1])
    raise EdgevlError(f"model_type {mt!r} (architectures {archs}) is not supported; edgevl converts: {supported}")


def all_architectures() -> list:
    return [get(n) for n in names()]
