"""Youtu-VL: ``model.py`` holds its vision graph, converter and registration (the language model is
Youtu-LLM's), ``runtime.py`` the vision driver and grounding output, ``processing.py`` the image
processor, ``chat_template.jinja`` its chat template."""

from .model import ARCH  # noqa: F401
