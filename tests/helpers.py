"""Builders for tiny random checkpoints with real layouts (transformers classes + tokenizers)."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np

from edgevl.demo.tokenizer import save_tokenizer, train_tokenizer
from edgevl.tokenizer import YOUTU_VL_TEMPLATE

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
    return train_tokenizer(CORPUS, vocab_size=vocab_size, vision=vision, n_coordinates=n_coordinates)


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
    (random nets are flat)."""
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


def make_youtu(folder, seed: int = 0, dtype: str = "fp32", max_shard_size=None, init_scale: float = 0.15,
               train_steps: int = 0, **overrides) -> Path:
    """A random (or briefly trained) YoutuForCausalLM checkpoint; overrides are YoutuConfig kwargs."""
    import torch
    from transformers import YoutuConfig, YoutuForCausalLM

    folder = Path(folder)
    tok = tiny_tokenizer()
    ids = save_tokenizer(tok, folder, chat_template=YOUTU_VL_TEMPLATE)
    theta = overrides.pop("rope_theta", 500000.0)
    cfg = dict(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48,
               qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=20, max_position_embeddings=512,
               rope_parameters={"rope_type": "default", "rope_theta": float(theta)},
               bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"],
               # no pad id: transformers 5.24 zeroes the pad row of the embedding when loading, which
               # would make the reference differ from the checkpoint it was saved from
               pad_token_id=None, tie_word_embeddings=True)
    cfg.update(overrides)
    if cfg.get("num_key_value_heads") != cfg["num_attention_heads"]:
        cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    torch.manual_seed(seed)
    model = init_random(YoutuForCausalLM(YoutuConfig(**cfg)).eval(), seed, init_scale)
    if train_steps:
        model = train_briefly(model, tok, train_steps, seed)
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kw)
    return folder


def load_hf(folder):
    import torch
    from transformers import YoutuForCausalLM

    return YoutuForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_greedy(model, input_ids, n: int) -> list[int]:
    """Greedy tokens from transformers with its KV cache, no early stop, no logits processors."""
    from edgevl.verify import reference_greedy

    return reference_greedy(model, "youtu", input_ids, n, eos=())


def config_of(folder) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))
