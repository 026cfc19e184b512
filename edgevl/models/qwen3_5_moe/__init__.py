"""Qwen3.5-MoE: ``model.py`` holds its sparse MoE block, converter and registration; the rest of
the decoder is Qwen3.5's (``edgevl/models/qwen3_5``), the MoE block ``edgevl/blocks/moe.py``."""

from .model import ARCH  # noqa: F401
