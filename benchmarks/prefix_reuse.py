"""What a second conversation with the same system prompt costs against the first.

    python benchmarks/prefix_reuse.py PKG [--words 160] [--rounds 5] [--threads 2] [--json OUT]

Each round starts from an empty cache, asks a question under a system prompt of ``--words``
words (the first conversation: the whole prompt is computed), then another question under the
same system prompt (the second: only what the cache cannot give is computed). Time to the first
token of each (one token generated), median over the rounds, and the tokens each computed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import edgevl

WORDS = ("You are a helpful assistant for a hardware store; answer briefly and politely, never "
         "invent prices, and ask when unsure.").split()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("package")
    ap.add_argument("--words", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    model = edgevl.load(a.package, threads=a.threads)
    system = " ".join(WORDS[i % len(WORDS)] for i in range(a.words))
    times: dict = {"first": [], "second": []}
    counts: dict = {}
    for r in range(a.rounds):
        model.reset()
        for kind, q in (("first", f"Do you sell hammers? ({r})"), ("second", f"When do you open? ({r})")):
            t = time.perf_counter()
            evs = list(edgevl.stream_events(model, [{"role": "system", "content": system},
                                                    {"role": "user", "content": q}], max_new_tokens=1, thinking=False))
            times[kind].append(time.perf_counter() - t)
            counts[kind] = {"prompt_tokens": evs[-1].prompt_tokens, "computed": evs[-1].prefill_tokens}
    model.close()
    out = {"package": a.package.rstrip("/").split("/")[-1], "threads": a.threads, "rounds": a.rounds,
           "seconds": {k: round(statistics.median(v), 3) for k, v in times.items()}, "tokens": counts,
           "all": {k: [round(x, 3) for x in v] for k, v in times.items()}}
    print(json.dumps(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
