"""Small byte-level BPE tokenizers with Youtu's pre-tokenizer and special tokens.

Used by the demo model and by tests that build random checkpoints: the files it writes have the
same layout and behaviour as a real Youtu checkpoint's (tokenizer.json + tokenizer_config.json),
only with a tiny vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

# docs/models/youtu_vl.md, section 9: CJK/Hangul/kana/fullwidth-punctuation runs split first...
CJK_SPLIT = (
    "[\uac00-\ud7a3\u3131-\u318e]+"
    "|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001-\u303f\ufe30-\ufe4f]+"
    "|[\u3105-\u312f]+"
    "|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
)
# ...then an o200k-style pattern with single digits.
_CONTRACTIONS = "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
WORD_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTIONS +
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS +
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
VISION_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
TASK_TOKENS = ["<ref>", "</ref>", "<box>", "</box>"]


def coordinate_tokens(n: int) -> list[str]:
    """<x_i>/<y_i> interleaved as in Youtu-VL (x_i then y_i for each i)."""
    out = []
    for i in range(n):
        out += [f"<x_{i}>", f"<y_{i}>"]
    return out


def train_tokenizer(texts, vocab_size: int = 512, vision: bool = True, n_coordinates: int = 0):
    """Train a byte-level BPE on ``texts``; returns a ``tokenizers.Tokenizer``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(CJK_SPLIT), behavior="isolated"),
        pre_tokenizers.Split(Regex(WORD_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    specials = [BOS, EOS] + (VISION_SPECIALS if vision else [])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    extra = (TASK_TOKENS + coordinate_tokens(n_coordinates)) if vision else []
    if extra:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra])
    return tok


def save_tokenizer(tok, folder, chat_template: str | None = None, model_max_length: int = 4096) -> dict:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja; returns the special ids."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
           "pad_token": EOS, "add_bos_token": False, "clean_up_tokenization_spaces": False,
           "model_max_length": model_max_length}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    if chat_template:
        (folder / "chat_template.jinja").write_text(chat_template)
    ids = {"bos_token_id": tok.token_to_id(BOS), "eos_token_id": tok.token_to_id(EOS),
           "pad_token_id": tok.token_to_id(EOS)}
    for name, key in (("<|vision_start|>", "vision_start_token_id"), ("<|vision_end|>", "vision_end_token_id"),
                      ("<|image_pad|>", "image_token_id"), ("<|video_pad|>", "video_token_id")):
        if tok.token_to_id(name) is not None:
            ids[key] = tok.token_to_id(name)
    return ids
