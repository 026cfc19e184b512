"""What constrained decoding costs per token, and what compiling a schema costs.

    python benchmarks/structured.py [--vocab 248320] [--package PKG] [--threads 2] [--json OUT]

- ``mask``: llguidance's per-token work (mask + consume, and applying the mask to a logits row)
  while writing a typical answer, on a byte-level BPE vocabulary of ``--vocab`` tokens (Qwen3.5's
  size by default; random byte strings of the real length mix, as no real tokenizer is bundled):
  the overhead a constrained token adds to a decode step, whatever the model.
- ``compile``: time from schema to a ready matcher (the tokenizer adapter once, then per schema).
- ``--package``: decode tok/s of that package with and without a constraint, side by side
  (interleaved rounds), greedy, with its drafting off and on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

SCHEMA = {"type": "object", "properties": {
    "store": {"type": "string", "maxLength": 24}, "total": {"type": "number", "minimum": 0},
    "items": {"type": "array", "maxItems": 8, "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24}, "qty": {"type": "integer", "minimum": 1},
        "price": {"type": "number"}}, "required": ["name", "qty", "price"], "additionalProperties": False}},
    "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
    "required": ["store", "total", "items", "date"], "additionalProperties": False}
ANSWER = ('{"store": "Corner Market", "total": 23.5, "items": [{"name": "apples", "qty": 3, "price": 4.5}, '
          '{"name": "bread", "qty": 1, "price": 3.2}, {"name": "milk", "qty": 2, "price": 1.9}], "date": "2026-03-14"}')


def synthetic_tokenizer(vocab: int, folder: Path) -> Path:
    """A byte-level BPE tokenizer.json with ``vocab`` tokens: the 256 bytes, the answer's words
    and random strings of 2-12 characters (no merges: the mask walks the whole token trie)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    rng = np.random.default_rng(0)
    tokens = dict.fromkeys(sorted(alphabet))
    letters = np.array(sorted(alphabet))
    while len(tokens) < vocab - 1:
        n = int(rng.integers(2, 13))
        tokens["".join(rng.choice(letters, n))] = None
    v = {t: i for i, t in enumerate(tokens)}
    v["<|im_end|>"] = len(v)
    tok = Tokenizer(models.BPE(vocab=v, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_end|>"])
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


def mask_cost(vocab: int) -> dict:
    import llguidance as llg

    from edgevl.structured import JSON_OPTIONS

    with tempfile.TemporaryDirectory() as d:
        path = synthetic_tokenizer(vocab, Path(d))
        t = time.perf_counter()
        tok = llg.LLTokenizer(path.read_text(), eos_token=vocab - 1)
        adapter_s = time.perf_counter() - t
    t = time.perf_counter()
    grammar = llg.LLMatcher.grammar_from_json_schema(SCHEMA, overrides=JSON_OPTIONS)
    template = llg.LLMatcher(tok, grammar, log_level=0)
    compile_s = time.perf_counter() - t
    ids = tok.tokenize_str(ANSWER)
    bits = np.empty((vocab + 31) // 32, np.int32)
    logits = np.random.default_rng(1).standard_normal(vocab).astype(np.float32)
    runs = []
    for _ in range(5):
        m = template.deep_copy()
        t = time.perf_counter()
        for i in ids:
            m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
            mask = np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab].astype(bool)
            np.where(mask, logits, -np.inf)
            assert m.consume_token(i), m.get_error()
        runs.append((time.perf_counter() - t) / len(ids))
    return {"vocab": vocab, "adapter_s": adapter_s, "compile_s": compile_s, "tokens": len(ids),
            "ms_per_token": 1e3 * statistics.median(runs), "ms_per_token_min": 1e3 * min(runs)}


def decode_speed(pkg: str, threads: int, rounds: int = 5, n: int = 128) -> dict:
    """Greedy decode tok/s of ``n`` tokens, free and under a constraint that never ends within them
    (lower-case words: the answer's length is the same either way), interleaved rounds."""
    import edgevl
    from edgevl import structured
    from edgevl.generate import prepare

    out = {}
    for spec in ("none", "mtp"):
        try:
            m = edgevl.load(pkg, threads=threads, speculative=spec)
        except edgevl.EdgevlError:
            continue
        ids = prepare(m, "Read the receipt.", thinking=False).input_ids
        comp = structured.compiled(m, structured.parse({"type": "regex", "regex": "[a-z ]+"}))
        for _ in range(rounds):
            for name in ("free", "constrained"):
                c = comp.constraint() if name == "constrained" else None
                gen = m.generate_tokens(ids, n, reuse_cache=False, ignore_eos=True, constraint=c)
                next(gen)
                t = time.perf_counter()
                k = sum(1 for _ in gen)
                out.setdefault(f"{spec} {name}", []).append(k / (time.perf_counter() - t))
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=248320)
    p.add_argument("--package", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    res = {"mask": mask_cost(a.vocab)}
    if a.package:
        res["decode"] = decode_speed(a.package, a.threads)
    print(json.dumps(res, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
