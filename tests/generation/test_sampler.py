"""The sampler's fast paths (top-k found in float32, top-p sorted over the largest tokens, the draw
over the tokens with mass) against the plain algorithm written out here: the same
distributions, bit for bit, and the same tokens for the same seeds."""

import numpy as np
import pytest

from edgevl.sample import Sampler


def plain_distribution(s: Sampler, logits, history=()):
    x = s._penalized(logits, history).astype(np.float64) / s.temperature
    if 0 < s.top_k < x.shape[0]:
        kth = np.partition(x, -s.top_k)[-s.top_k]
        x[x < kth] = -np.inf
    top = x.max()
    p = (x == top).astype(np.float64) if np.isinf(top) else np.exp(x - top)
    p /= p.sum()
    if s.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        keep = order[: int(np.searchsorted(np.cumsum(p[order]), s.top_p) + 1)]
        mask = np.zeros_like(p, dtype=bool)
        mask[keep] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    if s.min_p > 0:
        p = np.where(p < s.min_p * p.max(), 0.0, p)
        p /= p.sum()
    return p


SETTINGS = [dict(temperature=0.7, top_p=0.8, top_k=20), dict(temperature=1.0), dict(temperature=0.6, top_p=0.95),
            dict(temperature=1.3, top_p=0.999), dict(temperature=0.9, top_k=50),
            dict(temperature=2.0, top_p=0.5, top_k=1000), dict(temperature=0.3, top_p=0.9, repetition_penalty=1.3),
            dict(temperature=1.0, min_p=0.1), dict(temperature=0.8, top_p=0.95, top_k=40, min_p=0.05)]


@pytest.mark.parametrize("kw", SETTINGS, ids=[str(k) for k in SETTINGS])
def test_fast_sampling_is_the_plain_algorithm(kw):
    rng = np.random.default_rng(0)
    for trial in range(6):
        vocab = int(rng.choice([37, 5000, 20000]))
        scale = float(rng.choice([0.3, 3.0, 12.0]))        # flat rows, peaked rows
        fast, ref = Sampler(seed=trial, **kw), Sampler(seed=trial, **kw)
        history = list(rng.integers(0, vocab, 6))
        for step in range(8):
            x = (rng.standard_normal(vocab) * scale).astype(np.float32)
            if step % 3 == 0:
                x[rng.integers(0, vocab, 5)] = x.max()            # ties at the top
            p = plain_distribution(ref, x, history)
            assert np.array_equal(fast.distribution(x, history), p)
            assert fast(x, history) == int(ref.rng.choice(p.shape[0], p=p))


@pytest.mark.parametrize("kw", [dict(temperature=0.7, top_k=20, top_p=0.8), dict(temperature=1.0, min_p=0.1),
                                dict(temperature=1.3, top_k=100, top_p=0.9, min_p=0.05)])
def test_the_processors_are_transformers_in_its_order(kw):
    """The distribution is the one transformers' warpers give, applied in ``generate``'s order
    (temperature, top-k, top-p, min-p): the same tokens keep mass, with the same probabilities."""
    import torch
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = [TemperatureLogitsWarper(kw["temperature"])]
    if kw.get("top_k"):
        warpers.append(TopKLogitsWarper(kw["top_k"]))
    if kw.get("top_p"):
        warpers.append(TopPLogitsWarper(kw["top_p"]))
    if kw.get("min_p"):
        warpers.append(MinPLogitsWarper(kw["min_p"]))
    rng = np.random.default_rng(1)
    for _ in range(10):
        x = (rng.standard_normal(3000) * 4).astype(np.float32)
        scores = torch.from_numpy(x.astype(np.float64))[None]
        for w in warpers:
            scores = w(None, scores)
        want = torch.softmax(scores, -1)[0].numpy()
        got = Sampler(**kw).distribution(x)
        assert np.array_equal(got > 0, want > 0)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
