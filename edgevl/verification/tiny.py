"""Tiny random checkpoints with real layouts, for tests and the conformance suite.

Each family's ``make_tiny`` (``edgevl/verification/families``) builds on these: a small
byte-level BPE tokenizer trained on a multilingual corpus, deterministic well-conditioned random
weights, and an optional short training run (random nets have nearly flat logits, where reduced
precision flips near-ties).
Needs PyTorch and transformers (``pip install edgevl[verify]``).
"""

from __future__ import annotations

from functools import lru_cache

CORPUS = [
    "The quick brown fox jumps over the lazy dog. A red circle sits on the left.",
    "How many shapes are there? Two. What color is the square? Blue.",
    "Describe the image. A small green triangle at the top and a yellow star below it.",
    "Numbers like 12345 and 3.14159 are split into single digits by this tokenizer.",
    "你好，世界！今天天气很好。我们一起去公园散步吧。",
    "日本語のテキストも少し入れておきます。カタカナとひらがな。",
    "한국어 문장도 하나 있습니다.",
    "Emoji 🙂 and accents: café, naïve, Zürich — “quotes” and ‘single’ ones…",
    "def main():\n    print('hello world')\n    return 0\n",
] * 4


@lru_cache(maxsize=4)
def tiny_tokenizer(vocab_size: int = 400, vision: bool = True, n_coordinates: int = 0):
    from .tokenizers import train_tokenizer

    return train_tokenizer(CORPUS, vocab_size=vocab_size, vision=vision, n_coordinates=n_coordinates)


def chat_ids(tok, turn: str) -> list[int]:
    """CORPUS as chat turns, tokenized: each sentence a user message answered by the next one,
    written with the model's turn format ``turn`` (a format string with ``{user}`` and
    ``{answer}``). Trained on these, a tiny model has peaked logits on the prompts tests render."""
    sents = CORPUS[: len(CORPUS) // 4]
    return [t for i, s in enumerate(sents)
            for t in tok.encode(turn.format(user=s, answer=sents[(i + 1) % len(sents)])).ids]


def init_random(model, seed: int, scale: float = 0.15):
    """Deterministic, well-conditioned random weights; norm weights are not ones (so a wrong load shows)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(scale * torch.randn(p.shape, generator=g))
    return model


def train_briefly(model, tok, steps: int, seed: int = 0, ids=None, lr: float = 3e-3):
    """A few hundred Adam steps on CORPUS (or on token ``ids``): peaked, trained-like logits
    (random nets are flat).

    ``model(ids, labels=ids)`` must return an object with ``.loss`` (transformers' convention)."""
    import torch

    if ids is None:
        ids = [t for text in CORPUS[: len(CORPUS) // 4] for t in tok.encode(text).ids + [1]]
    data = torch.tensor(ids)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(data) - 65, (8,), generator=g)
        x = torch.stack([data[s:s + 65] for s in starts])
        loss = model(x[:, :-1], labels=x[:, :-1]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()
