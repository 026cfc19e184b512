"""What answering ``n`` times costs: the answers going on from one computation of the prompt
against each computing it, in the engine the server runs.

    python benchmarks/choices.py PKG [--n 4] [--words 300] [--tokens 32] [--rounds 3] [--threads 2] [--json OUT]

A prompt of ``--words`` words, ``--n`` sampled answers of ``--tokens`` tokens each through
``edgevl.stream_choices`` on an ``Engine`` with ``--n`` slots, no prefix reuse; "shared" is the
engine as it is (the later answers copy the first's state at the prompt's end), "each" the same
requests without that link (every answer computes the prompt). Interleaved rounds, each with a
prompt of its own; the median wall time of a request from its start to its last token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import edgevl
from edgevl.engine import Engine
from edgevl.generate import stream_choices

WORDS = ("the quick brown fox jumps over a lazy dog while seven cats watch from the old stone wall "
         "and a river runs past the mill where nobody has worked for years").split()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("package")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--words", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    model = edgevl.load(a.package, threads=a.threads)
    engine = Engine(model, parallel=a.n)
    linked = engine.generate_tokens

    def unlinked(*args, after=None, **kw):
        return linked(*args, **kw)

    times: dict = {"shared": [], "each": []}
    prompt_tokens = 0
    try:
        for r in range(a.rounds):
            for mode in times:
                engine.generate_tokens = linked if mode == "shared" else unlinked
                words = [WORDS[(i * 7 + r) % len(WORDS)] for i in range(a.words)]
                t = time.perf_counter()
                answers = stream_choices(model, " ".join(words) + f" ({mode} {r})", a.n, engine=engine,
                                         max_new_tokens=a.tokens, temperature=0.8, seed=r, thinking=False,
                                         reuse_cache=False)
                evs = [list(c) for c in answers]
                times[mode].append(time.perf_counter() - t)
                prompt_tokens = evs[0][-1].prompt_tokens
    finally:
        engine.close()
        model.close()
    out = {"package": a.package.rstrip("/").split("/")[-1], "n": a.n, "prompt_tokens": prompt_tokens,
           "tokens": a.tokens, "threads": a.threads, "rounds": a.rounds,
           "seconds": {k: round(statistics.median(v), 2) for k, v in times.items()},
           "all": {k: [round(x, 2) for x in v] for k, v in times.items()}}
    out["speedup"] = round(out["seconds"]["each"] / out["seconds"]["shared"], 2)
    print(json.dumps(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
