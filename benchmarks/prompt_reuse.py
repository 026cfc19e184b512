"""What computing a prompt once saves, in two cases.

    python benchmarks/prompt_reuse.py answers PKG [--n 4] [--words 300] [--tokens 32] [--rounds 3]
                                              [--threads 2] [--json OUT]
    python benchmarks/prompt_reuse.py system PKG [--words 160] [--rounds 5] [--threads 2] [--json OUT]
    python benchmarks/prompt_reuse.py image PKG [--size 384 | --video CLIP] [--rounds 5] [--threads 2] [--json OUT]

- ``answers``: a prompt of ``--words`` words, ``--n`` sampled answers of ``--tokens`` tokens each
  through ``edgevl.stream_choices`` on an ``Engine`` with ``--n`` slots, no prefix reuse. "shared"
  is the engine as it is (the later answers copy the first's state at the prompt's end), "each"
  the same requests without that link (every answer computes the prompt). The wall time of a
  request from its start to its last token.
- ``system``: each round starts from an empty cache, asks a question under a system prompt of
  ``--words`` words ("first": the whole prompt is computed), then another question under the same
  system prompt ("second": only what the cache cannot give is computed). Time to the first token
  of each (one token generated), and the tokens each computed.
- ``image``: each round a picture of its own (``--size`` square), a question about it ("first"), then
  the next turn as a chat client sends it (the conversation again, the picture included): "second"
  with the image cache (the picture is not encoded again), "second, encoded again" with the cache
  off (``image_cache_mb=0``), each after its own first turn from an empty cache. Time to the first
  token (one token generated). ``--video CLIP`` asks about a video file instead.

Interleaved rounds, each with prompts of its own; medians over the rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import edgevl
from edgevl.engine import Engine
from edgevl.generate import stream_choices

WORDS = {"answers": ("the quick brown fox jumps over a lazy dog while seven cats watch from the old stone wall "
                     "and a river runs past the mill where nobody has worked for years").split(),
         "system": ("You are a helpful assistant for a hardware store; answer briefly and politely, never "
                    "invent prices, and ask when unsure.").split()}


def answers(model, a, times: dict, out: dict) -> None:
    engine = Engine(model, parallel=a.n)
    linked = engine.generate_tokens

    def unlinked(*args, after=None, **kw):
        return linked(*args, **kw)

    words = WORDS["answers"]
    try:
        for r in range(a.rounds):
            for mode in ("shared", "each"):
                engine.generate_tokens = linked if mode == "shared" else unlinked
                prompt = " ".join(words[(i * 7 + r) % len(words)] for i in range(a.words))
                t = time.perf_counter()
                evs = [list(c) for c in stream_choices(model, f"{prompt} ({mode} {r})", a.n, engine=engine,
                                                       max_new_tokens=a.tokens, temperature=0.8, seed=r,
                                                       thinking=False, reuse_cache=False)]
                times.setdefault(mode, []).append(time.perf_counter() - t)
                out["prompt_tokens"] = evs[0][-1].prompt_tokens
    finally:
        engine.close()
    out.update(n=a.n, tokens=a.tokens)


def system(model, a, times: dict, out: dict) -> None:
    words = WORDS["system"]
    prompt = " ".join(words[i % len(words)] for i in range(a.words))
    counts = out.setdefault("tokens", {})
    for r in range(a.rounds):
        model.reset()
        for kind, q in (("first", f"Do you sell hammers? ({r})"), ("second", f"When do you open? ({r})")):
            t = time.perf_counter()
            evs = list(edgevl.stream_events(model, [{"role": "system", "content": prompt},
                                                    {"role": "user", "content": q}], max_new_tokens=1, thinking=False))
            times.setdefault(kind, []).append(time.perf_counter() - t)
            counts[kind] = {"prompt_tokens": evs[-1].prompt_tokens, "computed": evs[-1].prefill_tokens}


def image(model, a, times: dict, out: dict) -> None:
    import numpy as np
    from PIL import Image

    budget = model.image_cache.limit
    for r in range(a.rounds):
        y, x = np.mgrid[0:a.size, 0:a.size]
        pic = Image.fromarray(np.stack([(x * (r + 3)) % 256, (y * 5 + r * 40) % 256, (x + y) % 256], -1)
                              .astype(np.uint8))
        kind_of = "video" if a.video else "image"
        media = {"video": a.video} if a.video else {"image": [pic]}
        first = [{"role": "user", "content": [{"type": kind_of}, {"type": "text", "text": f"What is this? ({r})"}]}]
        second = first + [{"role": "assistant", "content": "A pattern of stripes."},
                          {"role": "user", "content": "What colours are in it?"}]
        for kind in (("second", "second, encoded again") if r % 2 else ("second, encoded again", "second")):
            model.reset()
            model.image_cache = type(model.image_cache)(budget if kind == "second" else 0)
            for turn, msgs in (("first", first), (kind, second)):
                t = time.perf_counter()
                evs = list(edgevl.stream_events(model, msgs, **media, max_new_tokens=1, thinking=False))
                times.setdefault(turn, []).append(time.perf_counter() - t)
                out.setdefault("tokens", {})[turn] = {"prompt_tokens": evs[-1].prompt_tokens,
                                                      "computed": evs[-1].prefill_tokens}
    out["size"] = a.size
    out["video"] = a.video


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("case", choices=["answers", "system", "image"])
    ap.add_argument("package")
    ap.add_argument("--n", type=int, default=4, help="answers: answers to the prompt")
    ap.add_argument("--words", type=int, default=None, help="the prompt's words (answers: 300, system: 160)")
    ap.add_argument("--tokens", type=int, default=32, help="answers: tokens per answer")
    ap.add_argument("--rounds", type=int, default=None, help="answers: 3, system: 5")
    ap.add_argument("--size", type=int, default=384, help="image: the picture's side in pixels")
    ap.add_argument("--video", default=None, help="image: ask about this video file instead (the same clip "
                                                  "every round)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    a.words = a.words or (300 if a.case == "answers" else 160)
    a.rounds = a.rounds or (3 if a.case == "answers" else 5)
    model = edgevl.load(a.package, threads=a.threads)
    times: dict = {}
    out: dict = {"case": a.case, "package": a.package.rstrip("/").split("/")[-1], "threads": a.threads,
                 "rounds": a.rounds}
    try:
        {"answers": answers, "system": system, "image": image}[a.case](model, a, times, out)
    finally:
        model.close()
    out["seconds"] = {k: round(statistics.median(v), 3) for k, v in times.items()}
    out["all"] = {k: [round(x, 3) for x in v] for k, v in times.items()}
    if a.case == "answers":
        out["speedup"] = round(out["seconds"]["each"] / out["seconds"]["shared"], 2)
    if a.case == "image":
        out["speedup"] = round(out["seconds"]["second, encoded again"] / out["seconds"]["second"], 2)
    print(json.dumps(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
