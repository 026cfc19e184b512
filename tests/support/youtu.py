"""Builders for tiny random checkpoints with real layouts (the architectures' own factories)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from edgevl.models.youtu_vl.model import CHAT_TEMPLATE as YOUTU_VL_TEMPLATE  # noqa: F401 - re-exported for tests
from edgevl.verification.families.youtu import VERIFY as YOUTU
from edgevl.verification.tiny import CORPUS, init_random, tiny_tokenizer, train_briefly  # noqa: F401


def make_youtu(folder, seed: int = 0, dtype: str = "fp32", max_shard_size=None, init_scale: float = 0.15,
               train_steps: int = 0, **overrides) -> Path:
    """A random (or briefly trained) YoutuForCausalLM checkpoint; overrides are YoutuConfig kwargs."""
    folder = Path(folder)
    return YOUTU.make_tiny(folder, "q_lora", seed, dtype, train_steps, max_shard_size=max_shard_size,
                           init_scale=init_scale, **overrides)


def load_hf(folder):
    import torch
    from transformers import YoutuForCausalLM

    return YoutuForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_greedy(model, input_ids, n: int) -> list[int]:
    """Greedy tokens from transformers with its KV cache, no early stop, no logits processors."""
    from edgevl.verification.reference import TransformersCausalLM

    return TransformersCausalLM(model).greedy(input_ids, n, eos=())


def config_of(folder) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


def first_diff(a, b):
    """Index of the first differing token of two sequences (None when one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
