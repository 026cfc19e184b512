"""Qwen3.5: ``model.py`` holds its whole decoder graph, converter and registration;
``chat_template.jinja`` its chat template. Its vision tower is Qwen3-VL's
(``edgevl/blocks/qwen_vision.py``), its image processor ``edgevl/processing/qwen_vl.py``."""

from .model import ARCH  # noqa: F401
