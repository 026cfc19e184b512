"""How many drafts per step: edgevl's rule (speculative.Trial.length) against fixed lengths and
other thresholds, simulated with measured step costs — the choice behind MIN_REACH and the prior.

    python benchmarks/draft_length.py [--plain 69] [--verify 71] [--draft 4.5] [--tokens 48]

Each generation draws, per draft, acceptance with probability p (times ``falloff`` per position
after the first: later drafts of a block applied to its own output are accepted less often);
a step costs ``--verify`` ms (2 or 4 rows; 3 rows are padded to 4) plus ``--draft`` ms per draft,
a plain step ``--plain`` ms, and the block's pass over the prompt 30 ms. Prints tok/s, the mean
of 300 generations per cell.
"""

from __future__ import annotations

import argparse

import numpy as np

from edgevl import speculative as S


def simulate(p: float, falloff: float, rule, a, seed: int) -> float:
    rng = np.random.default_rng(seed)
    t = S.Trial()
    tokens, ms = 1, 30.0
    while tokens < a.tokens:
        if not t.active:
            ms += a.plain
            t.update(0, 0, 1)
            tokens += 1
            continue
        k = rule(t)
        acc = 0
        while acc < k and rng.random() < p * falloff ** acc:
            acc += 1
        ms += a.verify + a.draft * k
        t.update(k, acc, acc + 1)
        tokens += acc + 1
    return tokens / ms * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plain", type=float, default=69.0)
    ap.add_argument("--verify", type=float, default=71.0)
    ap.add_argument("--draft", type=float, default=4.5)
    ap.add_argument("--tokens", type=int, default=48)
    a = ap.parse_args()

    rules = {"always 1": lambda t: 1, "always 3": lambda t: 3,
             **{f"reach >= {r:g}": (lambda t, r=r: t.length(3, r)) for r in (0.2, 0.25, 0.3)}}
    print(f"| acceptance | later drafts | {' | '.join(rules)} |")
    print("|---|---|" + "---|" * len(rules))
    for falloff in (1.0, 0.85):
        for p in (0.0, 0.5, 0.6, 0.8, 0.9):
            speeds = [np.mean([simulate(p, falloff, rule, a, s) for s in range(300)]) for rule in rules.values()]
            print(f"| {p:g} | x{falloff:g} each | " + " | ".join(f"{v:.2f}" for v in speeds) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
