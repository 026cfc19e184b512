"""Youtu-LLM: ``model.py`` holds its whole decoder graph, its converter and its registration."""

from .model import ARCH  # noqa: F401
