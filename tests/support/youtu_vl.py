"""Tiny random Youtu-VL checkpoints from the project's PyTorch reference: its config defaults (or
overrides), the shared test tokenizer with the vision tokens and 64 coordinate tokens."""

from __future__ import annotations

from edgevl.verification.references.youtu_vl import make_config, make_random
from edgevl.verification.tiny import tiny_tokenizer
from edgevl.verification.tokenizers import save_tokenizer


def make_vl(folder, seed, **overrides):
    """(folder, config) of a random YoutuVLForConditionalGeneration saved to ``folder``."""
    tok = tiny_tokenizer(400, True, 64)
    ids = save_tokenizer(tok, folder)
    ids.pop("pad_token_id")
    cfg = make_config(vocab_size=tok.get_vocab_size(), pad_token_id=None, **ids, **overrides)
    make_random(cfg, seed=seed).save_pretrained(folder)
    return folder, cfg
