"""Token selection from logits: greedy, or seeded sampling with the usual processors.

Order follows transformers' generate: repetition penalty, then temperature, top-k, top-p.
"""

from __future__ import annotations

import numpy as np

from .errors import EdgevlError


class Sampler:
    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 repetition_penalty: float = 1.0, seed: int | None = None):
        if temperature is None or temperature < 0:
            raise EdgevlError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        if top_k is None or top_k < 0:
            raise EdgevlError(f"top_k must be >= 0 (0 = off), got {top_k}")
        if top_p is None or not (0 < top_p <= 1):
            raise EdgevlError(f"top_p must be in (0, 1], got {top_p}")
        if repetition_penalty is None or repetition_penalty <= 0:
            raise EdgevlError(f"repetition_penalty must be > 0 (1 = off), got {repetition_penalty}")
        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)
        self.repetition_penalty = float(repetition_penalty)
        self.rng = np.random.default_rng(seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def __call__(self, logits: np.ndarray, history=()) -> int:
        x = np.asarray(logits, dtype=np.float32).copy()
        if self.repetition_penalty != 1.0 and len(history):
            ids = np.unique(np.asarray(history, dtype=np.int64))
            ids = ids[(ids >= 0) & (ids < x.shape[0])]
            v = x[ids]
            x[ids] = np.where(v > 0, v / self.repetition_penalty, v * self.repetition_penalty)
        if self.greedy:
            return int(np.argmax(x))
        x = x.astype(np.float64) / self.temperature
        if 0 < self.top_k < x.shape[0]:
            kth = np.partition(x, -self.top_k)[-self.top_k]
            x[x < kth] = -np.inf
        p = np.exp(x - x.max())
        p /= p.sum()
        if self.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            cum = np.cumsum(p[order])
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            keep = order[: int(np.searchsorted(cum, self.top_p) + 1)]
            mask = np.zeros_like(p, dtype=bool)
            mask[keep] = True
            p = np.where(mask, p, 0.0)
            p /= p.sum()
        return int(self.rng.choice(p.shape[0], p=p))
