"""Give a random benchmark checkpoint Qwen's real vocabulary in place of its stand-in tokenizer.

    python benchmarks/qwen_vocab.py TIKTOKEN CK OUT

A random checkpoint's small tokenizer splits text into a few characters a token, so a constrained
answer there has far more tokens — and far more of them forced by the grammar — than a real one.
``TIKTOKEN`` is Qwen's byte-level BPE as ranked tokens (``qwen.tiktoken``: 151 643 tokens, the ranks
Qwen's later tokenizers start from; Alibaba's ``dashscope`` wheel on PyPI ships it in
``dashscope/resources/``). This writes it as a tokenizer.json (merges recovered from the ranks, Qwen's
pre-tokenizer, its special tokens after the ranked ones, as Qwen numbers them), then ``OUT``: a copy
of checkpoint ``CK`` (the weights linked, not copied) with that tokenizer and its token ids in
config.json and generation_config.json. The model's vocabulary rows must cover the new ids.
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
from pathlib import Path

from edgevl.random_model import QWEN_NOT_SPECIAL, QWEN_PRETOKENIZE, QWEN_SPECIALS


def read_ranks(path: Path) -> dict:
    ranks = {}
    for line in path.read_text().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def merge_of(ranks: dict, token: bytes) -> tuple:
    """The two parts byte-level BPE joins last to make ``token``: merge its bytes by rank, never
    using a merge ranked at or after the token's own."""
    limit = ranks[token]
    parts = [bytes([b]) for b in token]
    while True:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < limit and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            break
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} is not one merge of two ranked tokens")
    return parts[0], parts[1]


def byte_unicode() -> dict:
    """GPT-2's byte-to-character map (the byte-level alphabet tokenizer.json spells tokens in)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


def tokenizer_from_ranks(ranks: dict):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    spell = byte_unicode()

    def text(b: bytes) -> str:
        return "".join(spell[x] for x in b)

    vocab = {text(t): r for t, r in ranks.items()}
    merges = [tuple(text(p) for p in merge_of(ranks, t)) for t, _ in sorted(ranks.items(), key=lambda kv: kv[1])
              if len(t) > 1]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIALS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_NOT_SPECIAL])
    return tok


def main() -> None:
    p = argparse.ArgumentParser(description="Give a random checkpoint Qwen's real vocabulary.")
    p.add_argument("tiktoken", type=Path, help="qwen.tiktoken (ranked byte-level BPE tokens)")
    p.add_argument("ck", type=Path, help="the checkpoint folder to copy")
    p.add_argument("out", type=Path, help="the new checkpoint folder")
    a = p.parse_args()
    tiktoken, ck, out = a.tiktoken, a.ck, a.out
    for path in (tiktoken, ck / "tokenizer.json", ck / "config.json"):
        if not path.is_file():
            p.error(f"{path} not found")
    tok = tokenizer_from_ranks(read_ranks(tiktoken))
    out.mkdir(parents=True, exist_ok=True)
    for f in ck.iterdir():
        dst = out / f.name
        if dst.exists() or dst.is_symlink():
            dst.unlink()
        if f.suffix == ".safetensors":
            dst.symlink_to(f.resolve())
        elif f.is_file():
            shutil.copy(f, dst)
    tok.save(str(out / "tokenizer.json"))
    old = json.loads((ck / "tokenizer.json").read_text())
    names = {a["id"]: a["content"] for a in old["added_tokens"]}
    new_id = {n: tok.token_to_id(n) for n in names.values()}

    def renumber(x):
        if isinstance(x, dict):
            return {k: renumber(v) if not k.endswith("token_id") and k != "eos_token_id" else ids(v)
                    for k, v in x.items()}
        return x

    def ids(v):
        if isinstance(v, list):
            return [ids(i) for i in v]
        return new_id[names[v]] if isinstance(v, int) and v in names else v

    for name in ("config.json", "generation_config.json"):
        if (ck / name).exists():
            cfg = json.loads((ck / name).read_text())
            (out / name).write_text(json.dumps(renumber(cfg), indent=2) + "\n")
    print(f"{out}: {tok.get_vocab_size()} tokens; ids now {new_id}")


if __name__ == "__main__":
    main()
