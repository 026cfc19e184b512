"""What tests of every area share: the repository's paths, prompts and the prompt corpus,
comparisons of token sequences and arrays, and test images."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgevl.verification.tiny import CORPUS  # noqa: F401 - re-exported for tests

ROOT = Path(__file__).resolve().parents[2]   # the repository
TESTS = ROOT / "tests"
# prompts the parity and precision tests run: English, Chinese, code, punctuation beyond ASCII
PROMPTS = ["Describe the image in one sentence.", "How many shapes are there? 数一数。",
           "def main():\n    return 42", "Zürich — “quotes”"]


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


def first_diff(a, b):
    """Index of the first differing token of two sequences (None when one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def noise_pixels(h, w, seed=0):
    """An ``h`` x ``w`` RGB array of uniform random bytes."""
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def smooth_image(w, h, seed=0, mode="RGB"):
    """A ``w`` x ``h`` image of random colours upscaled from 1/8 size: smooth, so resizing matters."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
    image = Image.fromarray(base).resize((w, h), Image.BICUBIC)
    return image if mode == "RGB" else image.convert(mode)


def child_peak_kb(code: str) -> int:
    """Run ``code`` in a fresh Python, where ``peak()`` gives the process's own peak resident
    memory in kB (VmHWM; ru_maxrss would carry pytest's size across fork+exec), and return the
    last number it printed."""
    import subprocess
    import sys

    head = ("def peak():\n    return int([ln.split()[1] for ln in open('/proc/self/status') "
            "if ln.startswith('VmHWM')][0])\n")
    r = subprocess.run([sys.executable, "-c", head + code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.split()[-1])
