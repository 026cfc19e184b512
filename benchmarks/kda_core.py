"""Time the Youtu MoE's KDA delta rule (``youtu_moe.KdaCore``, host numpy) at the real KDA shape
(32 heads of 128, 36 layers), with the caches cold between tokens as in a real decode (a 64 MB
array rewritten before each token, standing in for the weights streamed between layers).

    python benchmarks/kda_core.py [--heads 32] [--dim 128] [--layers 36] [--tokens 32]

Prints ms per token and layer for decode steps and for a 64-token prompt."""

from __future__ import annotations

import argparse
import time

import numpy as np

from edgevl.blocks import gated_delta as gd


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--tokens", type=int, default=32)
    a = ap.parse_args(argv)
    h, d, n = a.heads, a.dim, a.layers
    core = gd.KdaCore(gd.DeltaDims(h, h, d, d), -5.0)
    rng = np.random.default_rng(0)
    consts = core.consts(np.ones(h * d, np.float32), np.zeros(h * d, np.float32))
    states = [core.new_state(rng.standard_normal((h, d, d)).astype(np.float32)) for _ in range(n)]
    qkv = rng.standard_normal((64, 3 * h * d)).astype(np.float32)
    fb = rng.standard_normal((64, h * d + h)).astype(np.float32)
    junk = np.ones(64 << 18, np.float32)
    for label, rows, reps in (("decode", 1, a.tokens), ("prompt of 64", 64, 1)):
        spent = 0.0
        for _ in range(reps):
            junk += 1.0
            for i in range(n):
                t = time.perf_counter()
                _, states[i] = core(qkv[:rows], fb[:rows], consts, states[i])
                spent += time.perf_counter() - t
        print(f"{label}: {spent / reps / n / rows * 1000:.3f} ms per token and layer "
              f"({spent / reps / rows * 1000:.1f} ms per token for {n} layers)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
