"""What constrained decoding costs per token, and what compiling a schema costs.

    python benchmarks/structured.py [--vocab 248320] [--package PKG [--llama-server BIN --gguf FILE]]
                                    [--threads 2] [--tokens 128] [--rounds 5] [--json OUT]

- ``mask``: llguidance's per-token work (mask + consume, and applying the mask to a logits row)
  while writing a typical answer, on a byte-level BPE vocabulary of ``--vocab`` tokens (Qwen3.5's
  size by default; random byte strings of the real length mix, as no real tokenizer is bundled):
  the overhead a constrained token adds to a decode step, whatever the model.
- ``compile``: time from schema to a ready matcher (the tokenizer adapter once, then per schema).
- ``--package``: decode tok/s of that package with and without a constraint, side by side
  (interleaved rounds), greedy, with its drafting off and on; constrained twice, with the tokens
  the grammar forces fed together (the default) and one token a pass (``FORCED_MAX = 0``).
  ``--schema long`` (the default): an object with one string of at least 1000 characters (``LONG``),
  which does not end within the tokens asked for, so free and constrained answers have the same length and almost
  no token is forced. ``--schema receipt``: an extraction schema (``RECEIPT``: bounded strings,
  integers, an array of objects, an enum) whose answer ends; each answer's tokens are reported too.
  Run it on a checkpoint with a real vocabulary (``benchmarks/qwen_vocab.py``): a stand-in
  tokenizer of a few characters a token forces far more of them.
- ``--forced P``: the verifier accepts each draft with probability P whatever the model says
  (the drafts are among the allowed tokens; a rejection takes the best other allowed token):
  drafting at a given acceptance, on any checkpoint. Benchmark only.
- ``--llama-server``: the same, through llama.cpp's ``llama-server`` on the package's checkpoint
  as GGUF (``/completion`` with the prompt's token ids, ``json_schema`` for the constraint).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

SCHEMA = {"type": "object", "properties": {
    "store": {"type": "string", "maxLength": 24}, "total": {"type": "number", "minimum": 0},
    "items": {"type": "array", "maxItems": 8, "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24}, "qty": {"type": "integer", "minimum": 1},
        "price": {"type": "number"}}, "required": ["name", "qty", "price"], "additionalProperties": False}},
    "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
    "required": ["store", "total", "items", "date"], "additionalProperties": False}
# one string that cannot close within the tokens asked for (a random model soon closes a bare one)
LONG = {"type": "object", "properties": {"text": {"type": "string", "minLength": 1000}}, "required": ["text"],
        "additionalProperties": False}
# the extraction an application asks of a receipt photo, bounded so that a random model's answer ends
RECEIPT = {"type": "object", "properties": {
    "store": {"type": "string", "maxLength": 24},
    "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
    "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16}, "qty": {"type": "integer", "minimum": 1, "maximum": 99},
        "price_cents": {"type": "integer", "minimum": 0, "maximum": 99999}},
        "required": ["name", "qty", "price_cents"], "additionalProperties": False}},
    "total_cents": {"type": "integer", "minimum": 0, "maximum": 999999},
    "paid_by": {"enum": ["cash", "card", "phone"]}},
    "required": ["store", "date", "items", "total_cents", "paid_by"], "additionalProperties": False}
DECODE_SCHEMAS = {"long": LONG, "receipt": RECEIPT}
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


def force_acceptance(p: float) -> None:
    """Sampler.check accepts a draft with probability ``p`` (if allowed), else takes the best
    other token of its (masked) row."""
    from edgevl.sample import Sampler

    rng = np.random.default_rng(1234)

    def check(self, logits, history, draft):
        x = np.array(logits, np.float32)
        if rng.random() < p and np.isfinite(x[draft]):
            return int(draft)
        x[draft] = -np.inf
        return int(np.argmax(x)) if np.isfinite(x).any() else int(draft)    # the grammar's only token
    Sampler.check = check


def decode_speed(pkg: str, threads: int, rounds: int = 5, n: int = 128, server: str | None = None,
                 gguf: str | None = None, forced: float | None = None, schema: str = "long") -> dict:
    """Greedy decode tok/s of up to ``n`` tokens, free and under the ``schema`` (``DECODE_SCHEMAS``),
    interleaved rounds; llama-server's in the same rounds if given. Free answers and answers to
    ``long`` run to ``n`` tokens; a ``receipt`` answer ends where its JSON does."""
    import edgevl
    from edgevl import speculative, structured
    from edgevl.generate import prepare

    if forced is not None:
        force_acceptance(forced)

    out, tokens, models = {}, {}, {}
    for spec in ("none", "mtp"):
        try:
            models[spec] = edgevl.load(pkg, threads=threads, speculative=spec)
        except edgevl.EdgevlError:
            continue
    m0 = next(iter(models.values()))
    ids = prepare(m0, "Read the receipt.", thinking=False).input_ids
    body_schema = DECODE_SCHEMAS[schema]
    comp = {s: structured.compiled(m, structured.parse(None, body_schema)) for s, m in models.items()}
    jump = speculative.FORCED_MAX
    ends = schema != "long"
    proc = url = None
    if server:
        proc, url = start_llama(server, gguf, threads, len(ids) + n + 64)
    try:
        for _ in range(rounds):
            for spec, m in models.items():
                for name in ("free", "constrained", "constrained, a token a pass"):
                    c = comp[spec].constraint() if name != "free" else None
                    speculative.FORCED_MAX = 0 if name.endswith("pass") else jump
                    gen = m.generate_tokens(ids, n, reuse_cache=False, ignore_eos=not (ends and c), constraint=c)
                    next(gen)
                    t = time.perf_counter()
                    k = sum(1 for _ in gen)
                    out.setdefault(f"edgevl {spec} {name}", []).append(k / (time.perf_counter() - t))
                    tokens[f"edgevl {spec} {name}"] = k + 1
            speculative.FORCED_MAX = jump
            if url:
                for name in ("free", "constrained"):
                    body = {"prompt": [int(i) for i in ids], "n_predict": n, "temperature": 0, "top_k": 1,
                            "ignore_eos": not (ends and name == "constrained"), "cache_prompt": False}
                    if name == "constrained":
                        body["json_schema"] = body_schema
                    req = urllib.request.Request(f"{url}/completion", json.dumps(body).encode(),
                                                 {"Content-Type": "application/json"})
                    with urllib.request.urlopen(req, timeout=1800) as r:
                        t = json.loads(r.read())["timings"]
                    out.setdefault(f"llama.cpp {name}", []).append(t["predicted_per_second"])
                    tokens[f"llama.cpp {name}"] = t["predicted_n"]
    finally:
        speculative.FORCED_MAX = jump
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    res = {k: statistics.median(v) for k, v in out.items()}
    for who in ("edgevl none", "edgevl mtp", "llama.cpp"):
        if f"{who} free" in res:
            res[f"{who} ratio"] = res[f"{who} constrained"] / res[f"{who} free"]
    if "llama.cpp constrained" in res and "edgevl none constrained" in res:
        for name in ("constrained", "constrained, a token a pass"):
            res[f"edgevl none {name} / llama.cpp constrained"] = (res[f"edgevl none {name}"]
                                                                  / res["llama.cpp constrained"])
    res["schema"] = schema
    res["answer tokens"] = tokens
    return res


def start_llama(server: str, gguf: str, threads: int, ctx: int):
    """llama-server on a free port, once it answers /health (``serve.py``'s helpers)."""
    from serve import free_port, start_server

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [server, "-m", gguf, "--port", str(port), "-t", str(threads), "-tb", str(threads), "-c", str(ctx),
           "-np", "1", "--no-webui"]
    return start_server(cmd, url, "llama-server"), url


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=248320)
    p.add_argument("--package", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--llama-server", default=None)
    p.add_argument("--gguf", default=None)
    p.add_argument("--forced", type=float, default=None, help="accept each draft with this probability")
    p.add_argument("--schema", choices=sorted(DECODE_SCHEMAS), default="long")
    p.add_argument("--skip-mask", action="store_true", help="only the decode speeds")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    from serve import check_llama

    check_llama(p, a.llama_server, a.gguf)
    res = {} if a.skip_mask else {"mask": mask_cost(a.vocab)}
    if a.package:
        res["decode"] = decode_speed(a.package, a.threads, a.rounds, a.tokens, a.llama_server, a.gguf, a.forced,
                                     a.schema)
        res["forced"] = a.forced
    print(json.dumps(res, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
