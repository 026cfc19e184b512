"""The Youtu MoE hybrid: ``model.py`` holds its whole decoder graph, converter and registration;
``layout.py`` the assumed checkpoint layout (no checkpoint is public yet). Its blocks are shared:
KDA (``blocks/gated_delta.py``), MLA, M-RoPE, the MoE block and Qwen3-VL's vision tower."""

from .model import ARCH  # noqa: F401
